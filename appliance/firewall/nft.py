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
        """Add (sandbox, destination, port, timeout seconds) to the learned set, in one
        transaction. An existing element gets its timeout set again (`add` alone would keep
        the old one): add, delete and add again, so that the delete never misses and no
        flow ever sees the element gone."""
        if not entries:
            return
        elements = [{"elem": {"val": {"concat": [src, dst, port]}, "timeout": ttl}}
                    for src, dst, port, ttl in entries]
        self.run([_elements("add", elements), _elements("delete", elements),
                  _elements("add", elements)])

    def forget(self, keys: list[tuple[str, str, int]]) -> None:
        """Delete (sandbox, destination, port) elements from the learned set, in one
        transaction, whether or not each is still there (one that timed out meanwhile
        would fail a plain delete, and with it the whole transaction): each is added
        first, which does nothing to one that is there."""
        if not keys:
            return
        elements = [{"elem": {"val": {"concat": [src, dst, port]}, "timeout": 1}}
                    for src, dst, port in keys]
        self.run([_elements("add", elements), _elements("delete", elements)])

    def learned_keys(self) -> set[tuple[str, str, int]]:
        """The (sandbox, destination, port) of every element in the learned set now."""
        return {tuple(e["elem"]["val"]["concat"]) for e in self.learned_elements()}

    def counters(self) -> dict[str, dict]:
        return {item["counter"]["name"]: {"packets": item["counter"]["packets"],
                                          "bytes": item["counter"]["bytes"]}
                for item in self.list_table() or [] if "counter" in item}


def _elements(verb: str, elements: list[dict]) -> dict:
    return {verb: {"element": {"family": FAMILY, "table": TABLE, "name": LEARNED,
                               "elem": elements}}}
