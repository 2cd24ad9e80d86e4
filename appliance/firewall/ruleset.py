"""The nftables ruleset, as the JSON commands of one transaction. Pure: config in, JSON out.

Everything lives in its own table, `inet corral`; other tables (podman's netavark) are never
touched, and nothing is flushed but this table. The transaction creates the table if it is
missing, deletes it, and builds it anew, so the kernel swaps old for new atomically: if any
command fails, nothing changes and the previous ruleset stays in force.

Traffic from a sandbox interface (the `[firewall] interfaces` patterns):
  raw prerouting  drop spoofed sources (not a session subnet, or not routed back the way it came)
  nat prerouting  TCP 80/443 to non-local addresses -> the transparent listeners
  input           only DNS, the proxy listeners and the git gateway on the session's own
                  gateway; else reject
  forward         only (sandbox . destination . port) in the DNS-learned set, or a tcp rule
                  naming an IP; else reject. Nothing is routed in to a sandbox, so sessions
                  cannot reach each other. Established flows pass before the set is looked
                  at: taking a learned element back ends its flows in conntrack too
                  (learned.py), and their next packets meet these rejects as new ones.
IPv4 is held by the session subnets as well as by the interfaces: a session's rules match its
source addresses on any interface. IPv6 has no subnets to match, so it fails closed another
way: nothing is forwarded over IPv6 at all (flows established before the ruleset aside), from
whatever interface, and IPv6 to the appliance itself is rejected on sandbox interfaces.
Each session's rules live in chains of its own (`session_input_<session>`,
`session_forward_<session>`, `session_nat_<session>`), reached from the base chains through
verdict maps keyed by its subnet (`session_input`, `session_forward`, `session_nat`), with
its subnet in the set `sessions` that the spoofing rule reads: one lookup per packet however
many sessions there are, and a session that comes is one small transaction (`additions`),
not the whole ruleset again.
Every reject is counted per session (named counter `deny_<session>`), logged to NFLOG at a
limited rate (prefix "corral <session> "), and answered fast: TCP reset for TCP,
ICMP admin-prohibited for the rest.
Link-local multicast to the appliance (224.0.0.0/24, ff02::/16: the LLMNR and mDNS name
queries and group reports a host sends on every new link, the appliance's own looped back
among them) never leaves the link anyway: it is dropped and counted in one named counter,
`quiet_multicast`, never logged, so that it does not bury the rejects a person must see.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Iterable

from appliance.policy import Host, parse_address
from appliance.sessionconfig import FilterConfig, SessionConfig

from .nflog import LINK_LOCAL_MULTICAST

TABLE = "corral"
FAMILY = "inet"
LEARNED = "learned"
"""The set the DNS filter fills: sandbox address . destination address . port, with timeout."""
UNKNOWN = "unknown"
"""Counter/log name for traffic from a sandbox interface that belongs to no session."""
QUIET = "quiet_multicast"
"""The counter of link-local multicast from sandbox links, dropped without a report."""
SESSIONS = "sessions"
"""The set of session subnets: a sandbox's IPv4 source must be in one of them."""
DISPATCH = {"filter_input": "input", "filter_forward": "forward", "nat_prerouting": "nat"}
"""Base chain -> the prefix of each session's own chain there, and of the verdict map
(`session_<prefix>`) that jumps to it by source subnet."""


_TABLE = {"family": FAMILY, "name": TABLE}


def _t(**fields) -> dict:
    return {"family": FAMILY, "table": TABLE, **fields}


def _match(left, right, op: str = "==") -> dict:
    return {"match": {"op": op, "left": left, "right": right}}


def _payload(protocol: str, field: str) -> dict:
    return {"payload": {"protocol": protocol, "field": field}}


def _prefix(network: ipaddress.IPv4Network | ipaddress.IPv6Network) -> dict:
    return {"prefix": {"addr": str(network.network_address), "len": network.prefixlen}}


def _iifname(patterns: Iterable[str], key: str = "iifname") -> dict:
    names = list(patterns)
    right = names[0] if len(names) == 1 else {"set": names}
    return _match({"meta": {"key": key}}, right)


def _rule(chain: str, *expr, comment: str | None = None) -> dict:
    rule = _t(chain=chain, expr=list(expr))
    if comment:
        rule["comment"] = comment
    return {"add": {"rule": rule}}


def _chain(name: str, hook: str | None = None, kind: str = "filter", prio: int = 0) -> dict:
    chain = _t(name=name)
    if hook is not None:
        chain.update(type=kind, hook=hook, prio=prio, policy="accept")
    return {"add": {"chain": chain}}


def listener_ports(config: FilterConfig) -> dict[str, list[int]]:
    """The ports a sandbox may reach on its gateway; the firewall needs fixed numbers."""
    ports = {
        "dns": sorted({p for _, p in config.dns.listen}),
        "proxy": sorted({p for _, p in config.proxy.listen}),
        "transparent_http": sorted({p for _, p in config.proxy.transparent_http}),
        "transparent_tls": sorted({p for _, p in config.proxy.transparent_tls}),
        "sshgate": sorted({p for _, p in config.sshgate.listen}),
    }
    for key, values in ports.items():
        if 0 in values:
            raise ValueError(f"{config.path}: the firewall needs fixed {key} ports, not 0")
    for key in ("transparent_http", "transparent_tls"):
        if len(ports[key]) > 1:
            raise ValueError(f"{config.path}: [proxy] {key}: the firewall redirects to one port")
    return ports


def gateway_services(config: FilterConfig) -> frozenset[tuple[str, int]]:
    """(protocol, port) a session reaches on its gateway (listener_ports, leniently: a port
    0 of a test config is none): the firewall refuses them only past the session's limits."""
    tcp = {p for _, p in (*config.dns.listen, *config.proxy.listen,
                          *config.proxy.transparent_http, *config.proxy.transparent_tls,
                          *config.sshgate.listen)}
    udp = {p for _, p in config.dns.listen}
    return frozenset({("tcp", p) for p in tcp if p} | {("udp", p) for p in udp if p})


def _still_ours(learned: list[dict], subnets) -> list[dict]:
    """Learned elements whose sandbox address is in a current session's subnet. A stopped
    session's allowances must not pass to the next session that gets the same addresses."""
    kept = []
    for element in learned:
        source = ipaddress.ip_address(element["elem"]["val"]["concat"][0])
        if any(source in subnet for subnet in subnets):
            kept.append(element)
    return kept


def _deny_chain(name: str, group: int, rate: int, counts: dict | None = None) -> list[dict]:
    """Count, report (rate-limited) and reject: the one way anything is refused."""
    chain = f"deny_{name}"
    kept = (counts or {}).get(chain, {})
    return [
        {"add": {"counter": _t(name=chain, packets=kept.get("packets", 0),
                               bytes=kept.get("bytes", 0))}},
        _chain(chain),
        _rule(chain, {"counter": chain},
              {"limit": {"rate": rate, "burst": rate * 2, "per": "second"}},
              {"log": {"prefix": f"corral {name} ", "group": group}}),
        _rule(chain, _match({"meta": {"key": "l4proto"}}, "tcp"),
              {"reject": {"type": "tcp reset"}}),
        _rule(chain, {"reject": {"type": "icmpx", "expr": "admin-prohibited"}}),
    ]


def build(config: FilterConfig, static_tcp: dict[str, list[tuple[str, list[int]]]] | None = None,
          learned: list[dict] | None = None, counts: dict | None = None) -> list[dict]:
    """The whole ruleset as one transaction.

    `static_tcp`: per session, tcp rules that name an IP: (address, ports).
    `learned`, `counts`: the learned set's elements and the counters' values, carried over
    from the ruleset being replaced (a re-apply forgets neither).
    """
    fw = config.firewall
    static_tcp = static_tcp or {}
    sandbox_if = _iifname(fw.interfaces)
    ip_saddr = _payload("ip", "saddr")

    commands: list[dict] = [
        {"add": {"table": _TABLE}},  # so that the delete below cannot fail on first apply
        {"delete": {"table": _TABLE}},
        {"add": {"table": _TABLE}},
        {"add": {"set": _t(name=LEARNED, type=["ipv4_addr", "ipv4_addr", "inet_service"],
                           flags=["timeout"])}},
        {"add": {"set": _t(name=SESSIONS, type="ipv4_addr", flags=["interval"])}},
        _chain("raw_prerouting", "prerouting", prio=-300),
        _chain("nat_prerouting", "prerouting", kind="nat", prio=-100),
        _chain("filter_input", "input", prio=-5),
        _chain("filter_forward", "forward", prio=-5),
    ]
    learned = _still_ours(learned or [], [s.subnet for s in config.sessions])
    if learned:
        commands.append({"add": {"element": _t(name=LEARNED, elem=learned)}})
    for name in (UNKNOWN, "ipv6"):  # the sessions' own come with their chains, below
        commands += _deny_chain(name, fw.log_group, fw.log_rate, counts)
    # every counter but the sessions' first: nft lists them in the order they were made,
    # and a session added later (`additions`) must list as it would in a whole load
    kept = (counts or {}).get(QUIET, {})
    commands.append({"add": {"counter": _t(name=QUIET, packets=kept.get("packets", 0),
                                           bytes=kept.get("bytes", 0))}})
    # Each session's chains, then the verdict maps that lead to them: nftables refuses
    # (ENOENT) an element jumping to a chain made after its map in the same transaction.
    for session in config.sessions:
        commands += _session_chains(session, config, static_tcp.get(session.name, []), counts)
    commands += [{"add": {"map": _t(name=f"session_{prefix}", type="ipv4_addr", map="verdict",
                                    flags=["interval"])}} for prefix in DISPATCH.values()]
    for session in config.sessions:
        commands += _session_elements(session)

    # Spoofing: a sandbox speaks only from its own subnet, and only on its own bridge. (With
    # no session the set is empty: every IPv4 packet from a sandbox interface is dropped.)
    commands.append(_rule("raw_prerouting", sandbox_if, _match(
        {"meta": {"key": "nfproto"}}, "ipv4"), _match(ip_saddr, f"@{SESSIONS}", "!="),
        {"drop": None}, comment="source outside every session subnet"))
    commands.append(_rule("raw_prerouting", sandbox_if, _match(
        {"meta": {"key": "nfproto"}}, "ipv4"), _match(
        {"fib": {"result": "oif", "flags": ["saddr", "iif"]}}, False), {"drop": None},
        comment="reverse path: source not routed back through this interface"))

    # "in": either flag. With "==", nft compares the state with the two flags OR-ed together,
    # which no packet has: established flows then went on only while their learned element
    # stayed, and one of them could meet the session's reset between the element's removal
    # and the deletion of its conntrack entry (the cut saw it closed already, and the
    # destination's side of it was never told).
    forward_in = [_rule("filter_forward", _match({"ct": {"key": "state"}},
                                                 ["established", "related"], "in"),
                        {"accept": None})]
    # Not only from sandbox interfaces: a bridge whose name matches no pattern must not be
    # an IPv6 way out either (IPv4 is held there by the session subnets below).
    forward_in.append(_rule("filter_forward", _match(
        {"meta": {"key": "nfproto"}}, "ipv6"), {"jump": {"target": "deny_ipv6"}},
        comment="no IPv6 is forwarded"))
    commands += forward_in
    # Neighbour discovery only, so that a sandbox's IPv6 packet reaches the reject below
    # and fails fast; without it the sandbox cannot even send, and its connect hangs.
    commands.append(_rule("filter_input", sandbox_if, _match(
        _payload("icmpv6", "type"), {"set": ["nd-neighbor-solicit", "nd-neighbor-advert"]}),
        {"accept": None}, comment="IPv6 neighbour discovery: no data, fast rejects"))
    for network in LINK_LOCAL_MULTICAST:
        protocol = "ip" if network.version == 4 else "ip6"
        commands.append(_rule("filter_input", sandbox_if, _match(
            _payload(protocol, "daddr"), _prefix(network)), {"counter": QUIET},
            {"drop": None}, comment="link-local multicast: never leaves the link, counted "
            "quietly"))
    commands.append(_rule("filter_input", sandbox_if, _match(
        {"meta": {"key": "nfproto"}}, "ipv6"), {"jump": {"target": "deny_ipv6"}},
        comment="no IPv6 to the appliance"))

    for chain, prefix in DISPATCH.items():  # each session's own chain, by its subnet
        commands.append(_rule(chain, {"vmap": {"key": ip_saddr, "data": f"@session_{prefix}"}}))

    commands.append(_rule("filter_input", sandbox_if, {"jump": {"target": f"deny_{UNKNOWN}"}}))
    commands.append(_rule("filter_forward", sandbox_if,
                          {"jump": {"target": f"deny_{UNKNOWN}"}}))
    # A flow whose conntrack entry was deleted (a learned element taken back) comes back as
    # new, or as invalid with nf_conntrack_tcp_loose off. Invalid is dropped, not answered:
    # a reset for a live flow's out-of-window packet would end it.
    commands.append(_rule("filter_forward", _iifname(fw.interfaces, "oifname"), _match(
        {"ct": {"key": "state"}}, ["invalid"]), {"drop": None},
        comment="routed in, unknown to conntrack"))
    commands.append(_rule("filter_forward", _iifname(fw.interfaces, "oifname"), _match(
        {"ct": {"key": "state"}}, ["new"]), {"jump": {"target": f"deny_{UNKNOWN}"}},
        comment="nothing is routed in to a sandbox: no session reaches another"))
    return commands


def _limits(config: FilterConfig) -> dict[str, int]:
    """What one session may send the filter, enforced in the kernel: before a flood fills
    the queues that every session shares (one DNS socket, one listening socket each)."""
    fw = config.firewall
    return {"dns_packets": fw.dns_packets, "new_connections": fw.new_connections,
            "connections": 2 * (config.proxy.max_connections_per_session + config.dns.max_tcp)}


def _rate(per_second: int) -> dict:
    return {"limit": {"rate": per_second, "burst": 2 * per_second, "per": "second",
                      "inv": True}}


def _own_chains(session: SessionConfig) -> dict[str, str]:
    """DISPATCH's prefix -> the session's own chain behind that base chain. `session_` first:
    no session name makes one of the base chains' names (`nat_prerouting`)."""
    return {prefix: f"session_{prefix}_{session.name}" for prefix in DISPATCH.values()}


def _session_chains(session: SessionConfig, config: FilterConfig,
                    static: list[tuple[str, list[int]]], counts: dict | None = None) -> list:
    """The session's deny chain and its own chains with their rules. A packet reaches them
    only from the session's own source addresses: the elements of `_session_elements`."""
    fw = config.firewall
    own = _own_chains(session)
    commands = _deny_chain(session.name, fw.log_group, fw.log_rate, counts)
    commands += [_chain(chain) for chain in own.values()]
    return commands + _session_rules(session, listener_ports(config), _limits(config), static,
                                     own)


def _session_elements(session: SessionConfig) -> list:
    """The session's subnet in the set of sources a sandbox may use, and in each verdict
    map, leading to its own chain there."""
    subnet = _prefix(session.subnet)
    commands = [{"add": {"element": _t(name=SESSIONS, elem=[subnet])}}]
    for prefix, chain in _own_chains(session).items():
        commands.append({"add": {"element": _t(name=f"session_{prefix}", elem=[
            [subnet, {"jump": {"target": chain}}]])}})
    return commands


def _session_rules(session: SessionConfig, ports, limits, static, own: dict[str, str]
                   ) -> list:
    """The rules of the session's own chains (`own`: DISPATCH's prefix -> chain name)."""
    ip_saddr, ip_daddr = _payload("ip", "saddr"), _payload("ip", "daddr")
    tcp_dport = _payload("tcp", "dport")
    gateway = _match(ip_daddr, str(session.gateway))
    deny = {"jump": {"target": f"deny_{session.name}"}}
    l4 = {"meta": {"key": "l4proto"}}
    into, forward, nat = own["input"], own["forward"], own["nat"]
    rules = []
    tcp_ports = sorted({*ports["dns"], *ports["proxy"], *ports["transparent_http"],
                        *ports["transparent_tls"], *ports["sshgate"]})
    if ports["dns"]:
        rules.append(_rule(into, gateway, _match(l4, "udp"), _match(
            _payload("udp", "dport"), {"set": ports["dns"]}), _rate(limits["dns_packets"]),
            deny, comment="a DNS flood: kept out of the socket every session shares"))
    if tcp_ports:
        new = [gateway, _match(l4, "tcp"), _match(tcp_dport, {"set": tcp_ports}),
               _match({"ct": {"key": "state"}}, ["new"])]
        rules.append(_rule(into, *new, {"ct count": {
            "val": limits["connections"], "inv": True}}, deny,
            comment="past the session's connection caps"))
        rules.append(_rule(into, *new, _rate(limits["new_connections"]), deny,
                           comment="a connection flood: kept out of the shared accept queues"))
    if ports["dns"]:
        rules.append(_rule(into, gateway, _match(l4, "udp"), _match(
            _payload("udp", "dport"), {"set": ports["dns"]}), {"accept": None}))
    if tcp_ports:
        rules.append(_rule(into, gateway, _match(l4, "tcp"), _match(
            tcp_dport, {"set": tcp_ports}), {"accept": None}))
    rules.append(_rule(into, deny))

    not_local = _match({"fib": {"result": "type", "flags": ["daddr"]}}, "local", "!=")
    for key, port in (("transparent_http", 80), ("transparent_tls", 443)):
        if ports[key]:
            rules.append(_rule(nat, not_local, _match(l4, "tcp"), _match(tcp_dport, port),
                               {"redirect": {"port": ports[key][0]}}))

    rules.append(_rule(forward, _match(l4, "tcp"), _match(
        {"concat": [ip_saddr, ip_daddr, tcp_dport]}, f"@{LEARNED}"), {"accept": None},
        comment="tcp rules, learned from DNS answers"))
    for address, port_list in static:
        rules.append(_rule(forward, _match(l4, "tcp"), _match(ip_daddr, address),
                           _match(tcp_dport, {"set": port_list}), {"accept": None},
                           comment="tcp rule naming an address"))
    rules.append(_rule(forward, deny))
    return rules


def static_tcp_rules(store) -> dict[str, list[tuple[str, list[int]]]]:
    """Per session, the tcp rules that name an IPv4 address (no DNS answer teaches those):
    that address on the ports the session's policy allows there (a deny naming it wins)."""
    out: dict[str, list] = {}
    for name, session in store.sessions.items():
        static = _static_tcp(session.policy)
        if static:
            out[name] = static
    return out


def _static_tcp(policy) -> list[tuple[str, list[int]]]:
    out = []
    for rule in policy.rules:
        address = parse_address(rule.host) if rule.kind == "tcp" else None
        if address is None or address.version != 4:  # IPv6 has no path out
            continue
        literal = Host(address=address)
        ports = [p for p in sorted(rule.port.ports) if policy.decide_tcp(literal, p).allowed]
        if ports:
            out.append((str(address), ports))
    return out


def _static_tcp_changed(before, after) -> bool:
    """Whether a session both states hold names other addresses in its tcp rules. A session
    the change did not touch is the same object in both, and is not read again."""
    return any(after.sessions[name] is not session and
               _static_tcp(after.sessions[name].policy) != _static_tcp(session.policy)
               for name, session in before.sessions.items() if name in after.sessions)


def differs(before, after) -> bool:
    """Whether the ruleset for `after` differs from the one for `before` (a store, or a
    change to it): the sessions, and the tcp rules that name an address."""
    return (before.session_configs() != after.session_configs()
            or _static_tcp_changed(before, after))


def for_store(store, learned: list[dict] | None = None,
              counts: dict | None = None) -> list[dict]:
    """The ruleset for every session the store knows: the config's and those registered."""
    config = dataclasses.replace(store.config, sessions=store.session_configs())
    return build(config, static_tcp_rules(store), learned, counts)


def additions(before, after) -> list[dict] | None:
    """The transaction that takes the ruleset loaded for `before` (a store, or a change) to
    the one `for_store(after)` builds, when `after` only adds sessions: their deny chains,
    their own chains and the elements that lead to them, and nothing flushed, so the cost
    does not grow with the sessions already there. None when anything else differs (the
    config, a session that was there, its tcp rules naming addresses): load it all then."""
    old, new = before.session_configs(), after.session_configs()
    if ((after.config is not before.config and after.config != before.config)
            or len(new) <= len(old) or new[:len(old)] != old
            or _static_tcp_changed(before, after)):
        return None
    config = dataclasses.replace(after.config, sessions=new)
    commands: list[dict] = []
    for session in new[len(old):]:
        commands += _session_chains(session, config,
                                    _static_tcp(after.sessions[session.name].policy))
    for session in new[len(old):]:
        commands += _session_elements(session)
    # made, not added: a chain or counter that is there already (a ruleset that is not what
    # `before` says) fails the transaction, and the caller loads the whole ruleset instead
    return [{"create": c["add"]} if "add" in c and ("chain" in c["add"] or "counter" in c["add"])
            else c for c in commands]


def build_base(interfaces: Iterable[str]) -> list[dict]:
    """The boot ruleset, loaded before networking: sandbox interfaces reach nothing at all."""
    sandbox_if = _iifname(interfaces)
    commands = [
        {"add": {"table": _TABLE}},
        {"delete": {"table": _TABLE}},
        {"add": {"table": _TABLE}},
        _chain("filter_input", "input", prio=-5),
        _chain("filter_forward", "forward", prio=-5),
        *_deny_chain(UNKNOWN, 0, 1)[:2],
    ]
    commands.append(_rule(f"deny_{UNKNOWN}", {"counter": f"deny_{UNKNOWN}"}))
    commands.append(_rule(f"deny_{UNKNOWN}", _match({"meta": {"key": "l4proto"}}, "tcp"),
                          {"reject": {"type": "tcp reset"}}))
    commands.append(_rule(f"deny_{UNKNOWN}", {"reject": {"type": "icmpx",
                                                         "expr": "admin-prohibited"}}))
    for chain in ("filter_input", "filter_forward"):
        commands.append(_rule(chain, sandbox_if, {"jump": {"target": f"deny_{UNKNOWN}"}},
                              comment="boot: the filter is not configured yet"))
    commands.append(_rule("filter_forward", _iifname(interfaces, "oifname"),
                          {"jump": {"target": f"deny_{UNKNOWN}"}}))
    return commands
