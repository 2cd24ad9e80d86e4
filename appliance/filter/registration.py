"""Sessions registered and removed at run time (`session-add`, `session-remove`).

A session comes all or nothing: it is refused when the descriptor budget cannot hold it at
its caps (limits.DescriptorBudget), when a listener port on its gateway is taken (bound before
anything is written), or when the firewall cannot follow (`[firewall] manage`): nothing of
it stays. When it goes, its gateway's listeners close and its open approvals are written
off before a session of the same name can come.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from appliance.firewall.nft import NftError
from appliance.policystore import Change, PolicyStore

from . import gateways
from .approvals_file import ApprovalsFile
from .errors import ControlError
from .limits import DescriptorBudget
from .listeners import Listeners

log = logging.getLogger("corral.filter")


class Unaffordable(ControlError):
    """A session the descriptor budget cannot hold at its caps."""


class Unbound(ControlError):
    """A session whose gateway's listeners cannot be bound (a port that is taken)."""


class Registration:
    def __init__(self, store: PolicyStore, change: Callable[..., Awaitable[Change]],
                 budget: DescriptorBudget, listeners: Listeners, approvals: ApprovalsFile):
        """`change`: how a change reaches the store (changes.Changes.change)."""
        self.store, self.change, self.budget = store, change, budget
        self.listeners, self.approvals = listeners, approvals

    async def register(self, name: str, subnet: str, gateway: str | None, files: list[str]):
        """The session and whether it is new (registering it again changes nothing)."""
        bound: list = []

        def plan() -> Change:
            change = self.store.plan_register(name, subnet, gateway, files)
            if change.changed:
                try:
                    self.budget.check(len(change.session_configs()))
                except ValueError as exc:
                    raise Unaffordable(f"session {name} not registered: {exc}") from None
            if change.changed or name in self.listeners.unserved:  # again: its ports again
                try:  # before anything is written: a port that is taken refuses the session
                    bound.extend(self.listeners.bind_gateway(change.result[0]))
                except gateways.BindError as exc:
                    raise Unbound(f"session {name} not registered: {exc}") from None
            return change

        try:
            change = await self.change(plan)
        except BaseException as exc:
            for _, sock in bound:
                sock.close()
            if isinstance(exc, (NftError, ControlError)) and not isinstance(
                    exc, (Unaffordable, Unbound)):
                raise ControlError(f"session {name} not registered: the firewall could not "
                                   f"follow: {exc}") from None
            raise
        session, added = change.result
        await self.listeners.serve_gateway(session, bound)
        log.info("session %s %s: %s", name, "registered" if added else "unchanged",
                 session.subnet)
        return session, added

    async def unregister(self, name: str, forget_rules: bool) -> None:
        """The session goes (its runtime rules too with `forget_rules`)."""
        try:
            change = await self.change(lambda: self.store.plan_unregister(name, forget_rules))
        except (NftError, ControlError) as exc:
            raise ControlError(f"session {name} not unregistered: the firewall could not "
                               f"follow: {exc}") from None
        self.listeners.close_gateways({str(s.gateway) for s in change.session_configs()})
        await self.listeners.closed()  # in the workers too, before the call returns
        self.listeners.unserved.pop(name, None)
        # its approvals went with it: written off before a session of the same name can come
        await self.approvals.save()
        log.info("session %s unregistered%s", name, " (rules forgotten)" if forget_rules else "")
