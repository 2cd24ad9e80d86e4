"""Learned tcp allowances that a policy change takes back.

The DNS filter teaches the firewall's learned set the addresses of names a tcp rule allows
(firewall/learned.py); each element remembers the names that taught it. After every change
to the policy (or to where the inspected hosts live) `Revocation` asks the learned set, off
the loop, to judge every element again with `Reach` and to take back, connections and all,
what the policy in force no longer gives. Each cut is an event.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging

from appliance.event import Event
from appliance.firewall.learned import Cut, LearnedSet
from appliance.firewall.ledger import Key
from appliance.policy import Decision, Host
from appliance.policystore import PolicyStore

from .blocking import Blocking
from .events import EventBus
from .proxy.frontends import Frontends

log = logging.getLogger("corral.filter")
RETRY = 2.0
"""Seconds between attempts to take back learned tcp allowances while nftables refuses."""


class Reach:
    """The learned set's judge (`may_reach`)."""

    def __init__(self, store: PolicyStore, frontends: Frontends):
        self.store, self.frontends = store, frontends

    def may_reach(self, session: str, key: Key, name: str) -> Decision:
        """May `session`'s sandbox reach the element's destination and port as an address
        of `name`, under the policy in force now? Runs on blocking threads, and reads the
        store as a change's ruleset check does: a commit swaps whole references, so a
        reader sees one state or the next, never half of one."""
        current = self.store.sessions.get(session)
        if current is None:
            return Decision(False, f"session {session} is gone")
        sandbox, destination, port = key
        if ipaddress.ip_address(sandbox) not in current.subnet:
            return Decision(False, f"{sandbox} is no longer in session {session}'s subnet")
        host = Host(name=name)
        decision = current.policy.decide_tcp(host, port)
        if decision.allowed:  # a cidr rule that let a blocked address through may be gone
            check = current.policy.decide_address(ipaddress.ip_address(destination), host)
            if not check.allowed:
                return check
            # raw TCP to an inspected host's front-end would carry its requests unread
            shared = self.frontends.refusal(current.policy, host, destination, "tcp")
            if shared is not None:
                return shared
        return decision


class Revocation:
    def __init__(self, learned: LearnedSet | None, store: PolicyStore, bus: EventBus,
                 blocking: Blocking):
        self.learned, self.store, self.bus, self.blocking = learned, store, bus, blocking
        self.running: asyncio.Task | None = None
        """The pass under way, if any (tests wait for it)."""
        self._again = False

    def policy_changed(self) -> None:
        """After every change (on the loop): take back, off the loop, the learned elements
        the policy in force no longer allows. One pass at a time; changes that come while
        one runs ask for one more pass, not one each."""
        if self.learned is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a change made with no loop running: nothing has learned yet
            if len(self.learned.ledger):
                raise RuntimeError("learned tcp allowances are taken back on the filter's "
                                   "event loop, and none is running") from None
            return
        self._again = True
        if self.running is None:
            self.running = loop.create_task(self._revoke(), name="corral-revoke")

    async def _revoke(self) -> None:
        """Passes until one finds the policy unchanged since it began. A pass nftables
        refuses leaves the elements in the ledger and is tried again every RETRY seconds
        until one goes through (one event and one log line per such streak)."""
        failing = False
        try:
            while self._again:
                self._again = False
                try:
                    cuts = await self.blocking.run(self.learned.revoke)
                except Exception as exc:
                    if not failing:
                        log.error("learned tcp allowances not taken back: %s", exc)
                        self.bus.emit(Event(
                            session=None, client=None, kind="firewall", name=None,
                            verdict="error", rule=None, layer=None,
                            reason="learned tcp allowances the policy no longer gives "
                                   f"could not be taken back (trying again): {exc}"))
                    failing = self._again = True
                    await asyncio.sleep(RETRY)
                    continue
                if failing:
                    log.info("learned tcp allowances taken back after all")
                    failing = False
                self.report(cuts)
        finally:
            self.running = None

    def report(self, cuts: list[Cut]) -> None:
        """An event for each cut (those of a pass, or those start-up made)."""
        for cut in cuts:
            owner = None if cut.revoked.session else self.store.lookup(cut.revoked.key[0])[0]
            self.bus.emit(cut_event(cut, owner))


def cut_event(cut: Cut, owner: str | None) -> Event:
    """The event of a cut; `owner`: the session whose subnet holds the sandbox's address now,
    for an element that does not say whose it was."""
    revoked = cut.revoked
    sandbox, destination, port = revoked.key
    session = revoked.session or owner
    names = list(revoked.names)
    through = f" ({', '.join(names)})" if names else ""
    ended = cut.error or (f"{cut.connections} connection"
                          f"{'' if cut.connections == 1 else 's'} ended")
    rule = revoked.decision.rule
    return Event(session=session, client=sandbox, kind="firewall",
                 name=names[0] if names else None, port=port, address=destination,
                 verdict="deny", rule=rule.text if rule else None,
                 layer=rule.layer if rule else None, protocol="tcp",
                 reason=f"cut: {session or sandbox} -> {destination}:{port}{through}: "
                        f"{revoked.decision.reason}; {ended}",
                 names=names, connections=cut.connections,
                 **({"error": cut.error} if cut.error else {}))
