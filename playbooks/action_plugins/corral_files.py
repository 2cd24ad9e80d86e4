"""corral_files, on the control machine: a role's files in one module run, or in none.

Under emulation every module run costs seconds, and a template task costs two (a stat,
then the copy). A role's files go through this instead: each entry the appliance's state
fact (ansible_local.corral.files, read while facts were gathered) shows current, by digest,
mode, owner and group, is not sent at all; the others go to the corral_files module
(playbooks/library/) in one run, which compares them again and writes only what differs.
"""

from __future__ import annotations

import hashlib

from ansible.plugins.action import ActionBase


def current(entry: dict, seen: object) -> bool:
    """Whether the fact's record of entry["dest"] is exactly what the entry makes."""
    if not isinstance(seen, dict):
        return False
    return seen == {"sha256": hashlib.sha256(str(entry["content"]).encode()).hexdigest(),
                    "mode": str(entry["mode"]), "owner": str(entry["owner"]),
                    "group": str(entry["group"])}


def pending(entries: list[dict], task_vars: dict) -> list[dict]:
    """The entries the fact does not show current (all of them without the fact)."""
    state = (task_vars.get("ansible_local") or {}).get("corral")
    files = state.get("files") if isinstance(state, dict) else None
    files = files if isinstance(files, dict) else {}
    return [entry for entry in entries if not current(entry, files.get(entry["dest"]))]


REQUIRED = frozenset(("dest", "content", "mode", "owner", "group"))


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(("files",))

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        del tmp
        entries = self._task.args.get("files")
        if not isinstance(entries, list) or not all(
                isinstance(e, dict) and REQUIRED <= set(e) <= REQUIRED | {"validate"}
                for e in entries):  # a misspelt key (validtae:) would drop its check
            return {**result, "failed": True,
                    "msg": "files: a list of {dest, content, mode, owner, group[, validate]}"
                           " and nothing else"}
        send = pending(entries, task_vars or {})
        if not send:
            return {**result, "changed": False, "written": [],
                    "msg": f"{len(entries)} current (ansible_local.corral)"}
        result.update(self._execute_module(module_name="ansible.legacy.corral_files",
                                           module_args={"files": send}, task_vars=task_vars))
        return result
