"""The only code that talks to nftables: JSON through libnftables (Debian's python3-nftables).

Every call is one transaction; a failure raises NftError with libnftables' own message and
changes nothing.
"""

from __future__ import annotations

import json
import threading

from .ruleset import FAMILY, LEARNED, TABLE


def _errors(text: str | None) -> str:
    """libnftables echoes the whole JSON input around its error; keep the error lines."""
    lines = (text or "").strip().splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith(("{", "^")))


class NftError(RuntimeError):
    """nftables refused a command; the message is libnftables' error text."""


class Nft:
    def __init__(self):
        try:
            import nftables
        except ImportError:
            raise NftError("the nftables Python bindings are missing: apt-get install "
                           "python3-nftables, then scripts/setup links them into .venv") from None
        self._nft = nftables.Nftables()
        self._nft.set_json_output(True)
        self._nft.set_handle_output(False)
        self._lock = threading.Lock()  # libnftables contexts are not thread-safe

    def run(self, commands: list[dict]) -> dict:
        with self._lock:
            rc, output, error = self._nft.json_cmd({"nftables": commands})
        if rc != 0:
            raise NftError(_errors(error) or f"nftables failed with status {rc}")
        return output or {}

    def list_table(self) -> list[dict] | None:
        """The objects of table inet corral, or None when it is not loaded."""
        with self._lock:
            rc, output, error = self._nft.cmd(f"list table {FAMILY} {TABLE}")
        if rc != 0:
            if "No such file or directory" in (error or ""):
                return None
            raise NftError(error.strip())
        return [x for x in json.loads(output)["nftables"] if "metainfo" not in x]

    def learned_elements(self) -> list[dict]:
        """The learned set as elements that can be added again (remaining timeout kept)."""
        for item in self.list_table() or []:
            if item.get("set", {}).get("name") == LEARNED:
                out = []
                for element in item["set"].get("elem", []):
                    inner = element.get("elem", element)
                    expires = inner.get("expires", inner.get("timeout", 60))
                    if expires > 0:
                        out.append({"elem": {"val": inner["val"], "timeout": expires}})
                return out
        return []

    def apply(self, commands: list[dict]) -> None:
        self.run(commands)

    def learn(self, entries: list[tuple[str, str, int, int]]) -> None:
        """Add (sandbox, destination, port, timeout seconds) to the learned set. An existing
        element gets its timeout refreshed: deleting is avoided so no flow sees a gap."""
        if not entries:
            return
        elements = [{"elem": {"val": {"concat": [src, dst, port]}, "timeout": ttl}}
                    for src, dst, port, ttl in entries]
        self.run([{"add": {"element": {"family": FAMILY, "table": TABLE, "name": LEARNED,
                                       "elem": elements}}}])
        # `add` keeps an existing element's old timeout; refresh with a delete + add of
        # only those, in one transaction, so an element never disappears.
        self.run([
            {"delete": {"element": {"family": FAMILY, "table": TABLE, "name": LEARNED,
                                    "elem": elements}}},
            {"add": {"element": {"family": FAMILY, "table": TABLE, "name": LEARNED,
                                 "elem": elements}}},
        ])

    def counters(self) -> dict[str, dict]:
        return {item["counter"]["name"]: {"packets": item["counter"]["packets"],
                                          "bytes": item["counter"]["bytes"]}
                for item in self.list_table() or [] if "counter" in item}
