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


def stage(module: AnsibleModule, dest: str, want: bytes, mode: int, uid: int, gid: int,
          validate: str | None, staged: list[str]) -> str:
    """The new file beside dest, with its mode and owner, checked by validate; its path is
    kept in `staged` so that a failure removes it."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(dest) or ".", prefix=".corral-")
    staged.append(temporary)
    with os.fdopen(fd, "wb") as f:
        f.write(want)
        f.flush()
        os.fsync(f.fileno())
    os.chown(temporary, uid, gid)
    os.chmod(temporary, mode)
    if validate:
        rc, out, err = module.run_command(validate % temporary)
        if rc != 0:
            module.fail_json(msg=f"{dest}: `{validate}` refused the new file (exit {rc}); "
                                 "no file was replaced", stdout=out, stderr=err)
    return temporary


def _wanted(module: AnsibleModule, entry: dict) -> tuple[bytes, int, int, int]:
    dest = entry.get("dest")
    for key in ("mode", "owner", "group"):
        if not isinstance(entry.get(key), str):
            module.fail_json(msg=f"{dest}: {key} must be a string (mode as octal: \"0640\")")
    if not (len(entry["mode"]) == 4 and entry["mode"].startswith("0")
            and all(c in "01234567" for c in entry["mode"])):
        module.fail_json(msg=f"{dest}: mode {entry['mode']!r} is not an octal mode like \"0640\"")
    try:
        return (str(entry["content"]).encode(), int(entry["mode"], 8),
                pwd.getpwnam(entry["owner"]).pw_uid, grp.getgrnam(entry["group"]).gr_gid)
    except KeyError as exc:
        module.fail_json(msg=f"{dest}: no such user or group: {exc}")


def main() -> None:
    module = AnsibleModule(
        argument_spec={"files": {"type": "list", "elements": "dict", "required": True}},
        supports_check_mode=True)

    # every new file is written and checked before any replaces its old one: a file that
    # fails its check leaves all of them as they were, and the next run finds them all
    pending, diffs, staged = [], [], []
    try:
        for entry in module.params["files"]:
            dest = entry["dest"]
            want, mode, uid, gid = _wanted(module, entry)
            validate = entry.get("validate")
            if validate and "%s" not in validate:
                module.fail_json(msg=f"{dest}: validate must name the new file as %s")
            changed, before = differs(dest, want, mode, uid, gid)
            if not changed:
                continue
            if module._diff:
                diffs.append({"before_header": dest, "after_header": dest,
                              "before": before or "", "after": want.decode("utf-8", "replace")})
            temporary = None if module.check_mode else stage(
                module, dest, want, mode, uid, gid, validate, staged)
            pending.append((dest, temporary))
        for dest, temporary in pending:
            if temporary is not None:
                os.replace(temporary, dest)
    finally:
        for temporary in staged:
            if os.path.exists(temporary):
                os.unlink(temporary)
    written = [dest for dest, _ in pending]
    module.exit_json(changed=bool(written), written=written, diff=diffs)


if __name__ == "__main__":
    main()
