"""The firewall as the filter drives it: the ruleset for a state of the policy store,
loaded with the learned tcp allowances in one transaction (`apply`), and what nftables has
loaded now, for `status` (`look`). Both block (libnftables): off the loop once serving."""

from __future__ import annotations

import logging

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


class Firewall:
    def __init__(self, nft: Nft | None, learned: LearnedSet | None):
        self.nft, self.learned = nft, learned

    def apply(self, state, end_strangers: bool = False, before=None) -> list[Cut]:
        """Load the ruleset for every session of `state` (the store, or a change about to be
        committed) in one transaction, with the learned elements of those sessions: read
        from the learned set's ledger and loaded under its lock, so that nothing learned
        meanwhile is lost. Raises on refusal. With `end_strangers` (start-up): what a
        previous filter left in the learned set is not carried over, and the cuts of their
        connections are returned.

        `before`: the state whose ruleset is loaded now (the store). When `state` only adds
        sessions to it, only theirs is loaded (`ruleset.additions`: a few milliseconds with
        hundreds of sessions, where the whole is hundreds); if nftables refuses that, the
        whole ruleset is loaded instead, and its refusal raises."""
        if self.nft is None or self.learned is None:
            raise ControlError("the filter manages the firewall but nftables is unavailable")
        added = ruleset.additions(before, state) if before is not None else None
        if added is not None and not end_strangers:
            try:
                self.nft.apply(added)
                return []
            except NftError as exc:
                log.warning("firewall: a new session's rules alone were refused (%s); "
                            "loading the whole ruleset", exc)
        sessions = {s.name for s in state.session_configs()}
        counts = self.nft.counters()
        return self.learned.apply(lambda learned: ruleset.for_store(state, learned, counts),
                                  sessions, end_strangers)

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
