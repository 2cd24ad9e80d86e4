"""Open approvals (ask mode) under the policy in force: after every change a session that
is gone takes its approvals and the requests held for them, and every other open approval
is judged again (`Holds.settle`): the policy may allow it now, or no longer let a person
approve it."""

from __future__ import annotations

from appliance.policy import parse_host, split_host_port
from appliance.policystore import PolicyStore

from .approvals import Holds, approvable, decide_kind


class OpenApprovals:
    def __init__(self, store: PolicyStore, holds: Holds):
        self.store, self.holds = store, holds

    def policy_changed(self) -> None:
        """A store listener: forget the gone sessions' approvals, settle the others."""
        for session in {p.session for p in self.holds.book.pending.values()}:
            if session not in self.store.sessions:
                self.holds.forget(session)
        self.holds.settle(self.still_open)

    def still_open(self, pending) -> tuple[bool | None, str]:
        """An open approval under the policy in force now (see Holds.settle): True and why
        when the policy allows it now, False and why when a person may no longer approve
        it, None otherwise (with why when ask mode was turned off)."""
        policy = self.store.sessions[pending.session].policy
        name, port = split_host_port(pending.target)
        decision = decide_kind(policy, pending.kind, parse_host(name),
                               int(port) if port else None)
        if decision.allowed:
            return True, f"the policy allows it now: {decision.reason}"
        if not approvable(decision):
            return False, f"{decision.reason}: no longer something a person can approve"
        if not policy.hold and pending.waiting:
            return None, "ask mode was turned off"
        return None, ""
