"""The firewall as the filter drives it: the ruleset for a state of the policy store,
loaded with the learned tcp allowances in one transaction (`apply`), and what nftables has
loaded now, for `status` (`look`). Both block (libnftables): off the loop once serving."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from appliance.firewall import ruleset
from appliance.firewall.learned import Cut, LearnedSet
from appliance.firewall.nft import Nft, NftError

from .errors import ControlError

log = logging.getLogger("corral.filter")


def nftables() -> Nft | None:
    """The kernel's nftables, or None where they are not available to this process."""
    try:
        return Nft()
    except NftError as exc:
        log.warning("tcp rules cannot be enforced: %s", exc)
        return None


@dataclass(frozen=True)
class Loaded:
    """What the filter last loaded into nftables, in the store's shape (`config`,
    `sessions`, `session_configs()`): what a session that comes is added to. Sessions and
    their policies never change in place, so holding them holds what was loaded."""

    config: object
    sessions: dict
    configs: tuple

    @classmethod
    def of(cls, state) -> Loaded:
        return cls(state.config, dict(state.sessions), tuple(state.session_configs()))

    def session_configs(self) -> tuple:
        return self.configs


class Firewall:
    def __init__(self, nft: Nft | None, learned: LearnedSet | None):
        self.nft, self.learned = nft, learned
        self.loaded: Loaded | None = None
        """What this filter last loaded (None: nothing yet, or a load that may have been
        refused half-way is not trusted: the whole ruleset goes next)."""

    def apply(self, state, end_strangers: bool = False) -> list[Cut]:
        """Load the ruleset for every session of `state` (the store, or a change about to be
        committed) in one transaction, with the learned elements of those sessions: read
        from the learned set's ledger and loaded under its lock, so that nothing learned
        meanwhile is lost. Raises on refusal. With `end_strangers` (start-up): what a
        previous filter left in the learned set is not carried over, and the cuts of their
        connections are returned.

        When `state` only adds sessions to what this filter loaded last, only theirs is
        loaded (`ruleset.additions`: milliseconds with hundreds of sessions, where the whole
        is hundreds): not relative to the store, which may hold what nftables never got (a
        change whose firewall step failed and was committed all the same, or one loaded and
        never committed). The whole ruleset is loaded instead when the learned set still
        holds an element from a new session's subnet (a session gone, whose allowance was
        not taken back), or when nftables refuses the small transaction."""
        if self.nft is None or self.learned is None:
            raise ControlError("the filter manages the firewall but nftables is unavailable")
        if not end_strangers and self.loaded is not None:
            added = ruleset.additions(self.loaded, state)
            if added is not None and self._add(added, state):
                return []
        sessions = {s.name for s in state.session_configs()}
        counts = self.nft.counters()
        self.loaded = None  # until this one is in
        cuts = self.learned.apply(lambda learned: ruleset.for_store(state, learned, counts),
                                  sessions, end_strangers)
        self.loaded = Loaded.of(state)
        return cuts

    def _add(self, commands: list[dict], state) -> bool:
        """Load the new sessions' commands alone; False: load the whole ruleset instead."""
        new = state.session_configs()[len(self.loaded.configs):]
        with self.learned.lock:  # nothing is learned for a subnet meanwhile
            if self.learned.ledger.holds_any([s.subnet for s in new]):
                return False
            try:
                self.nft.apply(commands)
            except NftError as exc:
                log.warning("firewall: a new session's rules alone were refused (%s); "
                            "loading the whole ruleset", exc)
                return False
        self.loaded = Loaded.of(state)
        return True

    def look(self) -> dict:
        """The loaded ruleset as `status` shows it: rules and counters, or why not."""
        if self.nft is None:
            return {"loaded": False, "error": "nftables is not available to the filter"}
        try:
            items = self.nft.list_table()
        except Exception as exc:  # status must answer whatever nftables says
            return {"loaded": False, "error": str(exc)}
        if items is None:
            return {"loaded": False, "error": "table inet corral is not loaded"}
        return {"loaded": True, "rules": sum(1 for i in items if "rule" in i),
                "counters": {i["counter"]["name"]: i["counter"]["packets"]  # battery.confirm
                             for i in items if "counter" in i}}
