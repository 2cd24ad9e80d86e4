#!/usr/bin/python
"""corral_files, on the appliance: write files whose content, mode, owner or group differ."""

from __future__ import annotations

import grp
import os
import pwd
import stat
import tempfile

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: corral_files
short_description: Write several files in one run, each only where it differs
description:
  - Each file is compared by content, mode, owner and group; one that differs is written to
    a temporary file beside it, given its mode and owner, checked with its validate command
    if it has one, and renamed over the old (never half-written).
  - The action plugin of the same name sends only the files the state fact does not show
    current, so a run where nothing differs starts no module at all.
options:
  files:
    description: The files, each a dict of dest, content, mode (octal string), owner, group
      and optionally validate (a command with %s for the new file's path).
    type: list
    elements: dict
    required: true
"""



def differs(dest: str, want: bytes, mode: int, uid: int, gid: int) -> tuple[bool, str | None]:
    """Whether dest differs, and its old text (None where there was no regular file)."""
    try:
        info = os.lstat(dest)
    except FileNotFoundError:
        return True, None
    if not stat.S_ISREG(info.st_mode):
        return True, None
    with open(dest, "rb") as f:
        before = f.read()
    same = (before == want and stat.S_IMODE(info.st_mode) == mode and info.st_uid == uid
            and info.st_gid == gid)
    return not same, before.decode("utf-8", "replace")


def write(module: AnsibleModule, dest: str, want: bytes, mode: int, uid: int, gid: int,
          validate: str | None) -> None:
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(dest) or ".", prefix=".corral-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(want)
            f.flush()
            os.fsync(f.fileno())
        os.chown(temporary, uid, gid)
        os.chmod(temporary, mode)
        if validate:
            rc, out, err = module.run_command(validate % temporary)
            if rc != 0:
                module.fail_json(msg=f"{dest}: `{validate}` refused the new file (exit {rc})",
                                 stdout=out, stderr=err)
        os.replace(temporary, dest)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def main() -> None:
    module = AnsibleModule(
        argument_spec={"files": {"type": "list", "elements": "dict", "required": True}},
        supports_check_mode=True)

    written, diffs = [], []
    for entry in module.params["files"]:
        dest = entry["dest"]
        try:
            want = str(entry["content"]).encode()
            mode = int(str(entry["mode"]), 8)
            uid = pwd.getpwnam(entry["owner"]).pw_uid
            gid = grp.getgrnam(entry["group"]).gr_gid
        except (KeyError, ValueError) as exc:
            module.fail_json(msg=f"{dest}: {exc}")
        validate = entry.get("validate")
        if validate and "%s" not in validate:
            module.fail_json(msg=f"{dest}: validate must name the new file as %s")
        changed, before = differs(dest, want, mode, uid, gid)
        if not changed:
            continue
        written.append(dest)
        diffs.append({"before_header": dest, "after_header": dest,
                      "before": before or "", "after": want.decode("utf-8", "replace")})
        if not module.check_mode:
            write(module, dest, want, mode, uid, gid, validate)
    module.exit_json(changed=bool(written), written=written, diff=diffs)


if __name__ == "__main__":
    main()
