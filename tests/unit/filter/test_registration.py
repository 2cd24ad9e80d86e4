"""Sessions registered and removed at run time (registration.py): all or nothing. The real
store, change runner, listeners (real sockets, bound with IP_FREEBIND on the sessions'
gateway addresses, which no interface needs to hold) and approvals file."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import pytest

from appliance.filter import gateways
from appliance.filter.approvals import Approvals
from appliance.filter.approvals_file import ApprovalsFile
from appliance.filter.blocking import Blocking
from appliance.filter.changes import Changes
from appliance.filter.control import ControlError
from appliance.filter.events import EventBus
from appliance.filter.firewalled import Firewall
from appliance.filter.limits import DescriptorBudget
from appliance.filter.listeners import Listeners
from appliance.filter.registration import Registration, Unaffordable, Unbound
from appliance.policystore import PolicyStore
from tests.unit.filterconfig import one_session

S3_GATEWAY = "10.213.3.1"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Parts:
    def __init__(self, tmp_path, manage: bool = False, limit: int = 1 << 20):
        self.port = free_port()
        self.config = one_session(tmp_path, f'[proxy]\nlisten = ["gateway:{self.port}"]')
        if manage:
            self.config = dataclasses.replace(self.config, firewall=dataclasses.replace(
                self.config.firewall, manage=True))
        self.store, self.bus, self.blocking = PolicyStore(self.config), EventBus(), Blocking()
        self.changes = Changes(self.store, self.blocking, Firewall(None, None), manage)
        self.accepted: list = []

        async def serve(sock):
            return await asyncio.start_server(lambda r, w: self.accepted.append(w), sock=sock)

        self.listeners = Listeners(self.config, self.store, self.bus, {"proxy": serve})
        self.approvals = ApprovalsFile(tmp_path / "state" / "approvals.json", Approvals(),
                                       self.store.identity)
        self.registration = Registration(self.store, self.changes.change,
                                         DescriptorBudget(self.config, limit), self.listeners,
                                         self.approvals)


@pytest.fixture
def parts(tmp_path):
    made = Parts(tmp_path)
    yield made
    made.listeners.close()
    made.blocking.shutdown()


def test_a_session_gets_its_gateway_listeners_and_loses_them_when_it_goes(parts):
    async def main():
        session, added = await parts.registration.register("s3", "10.213.3.0/24", None, [])
        again = await parts.registration.register("s3", "10.213.3.0/24", None, [])
        listening = dict(parts.listeners.names)
        await parts.registration.unregister("s3", forget_rules=False)
        return session, added, again[1], listening

    session, added, again, listening = asyncio.run(main())
    assert added and not again and str(session.gateway) == S3_GATEWAY
    assert listening == {"proxy": [f"{S3_GATEWAY}:{parts.port}"]}
    assert parts.listeners.names == {} and "s3" not in parts.store.sessions


def test_a_session_whose_port_is_taken_is_refused_naming_it_and_nothing_stays(parts):
    taken = gateways.bind(S3_GATEWAY, parts.port, "tcp")
    taken.listen()
    try:
        with pytest.raises(Unbound, match=rf"s3 not registered: cannot bind "
                           rf"{S3_GATEWAY}:{parts.port} \(tcp\)"):
            asyncio.run(parts.registration.register("s3", "10.213.3.0/24", None, []))
    finally:
        taken.close()
    assert "s3" not in parts.store.sessions and parts.store.registered == ()
    assert not parts.store.registered_path.exists() and parts.listeners.names == {}
    # the port, once free, is the session's: nothing of the refused attempt holds it
    _, added = asyncio.run(parts.registration.register("s3", "10.213.3.0/24", None, []))
    assert added and parts.listeners.names == {"proxy": [f"{S3_GATEWAY}:{parts.port}"]}


def test_a_session_the_descriptor_budget_cannot_hold_is_refused_before_anything_is_bound(
        tmp_path):
    made = Parts(tmp_path, limit=2048)
    try:
        with pytest.raises(Unaffordable, match="s3 not registered: "):
            asyncio.run(made.registration.register("s3", "10.213.3.0/24", None, []))
        assert "s3" not in made.store.sessions and made.listeners.names == {}
    finally:
        made.blocking.shutdown()


def test_a_firewall_that_cannot_follow_refuses_the_session_and_frees_its_ports(tmp_path):
    made = Parts(tmp_path, manage=True)  # and no nftables: the firewall cannot follow
    try:
        with pytest.raises(ControlError, match=r"s3 not registered: the firewall could not "
                           r"follow: .*nftables is unavailable"):
            asyncio.run(made.registration.register("s3", "10.213.3.0/24", None, []))
        assert "s3" not in made.store.sessions and made.listeners.names == {}
        gateways.bind(S3_GATEWAY, made.port, "tcp").close()  # the port was let go
    finally:
        made.blocking.shutdown()
