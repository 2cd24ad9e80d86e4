"""What corral's ruleset does with one packet, read from the JSON commands `ruleset.build`
returns: the base chain of a hook walked rule by rule as nftables walks it. It knows exactly
the expressions the ruleset uses and raises on any other, so it cannot misjudge a rule it
does not understand. The e2e tier loads the same commands into real nftables; this lets
unit tests ask table-style questions ("this packet, on this interface: accepted?").
"""

from __future__ import annotations

import fnmatch
import ipaddress
from dataclasses import dataclass, field


@dataclass
class Packet:
    iif: str
    saddr: str
    daddr: str
    l4: str = "tcp"
    """tcp, udp or icmpv6."""
    dport: int = 443
    oif: str = "up0"
    state: str = "new"
    icmpv6_type: str = ""
    local: bool = False
    """The destination is one of the appliance's own addresses."""
    routed_back: bool = True
    """The reverse path check: the source is routed back through `iif`."""
    learned: set = field(default_factory=set)
    """(saddr, daddr, dport) elements of the learned set."""
    flooding: bool = False
    """The session sends faster than a rule's `limit rate over` allows."""
    connections: int = 0
    """The session's connections conntrack counts (`ct count over`)."""

    @property
    def family(self) -> str:
        return f"ipv{ipaddress.ip_address(self.saddr).version}"


class Unknown(AssertionError):
    pass


def _chains(commands: list[dict]) -> tuple[dict[str, list[list[dict]]], dict[str, list]]:
    """The chains' rules and the named sets' and maps' elements, as the commands leave them
    (one whole ruleset, or one followed by `additions`)."""
    chains: dict[str, list[list[dict]]] = {}
    elements: dict[str, list] = {}
    for command in commands:
        added = command.get("add") or command.get("create") or {}
        if "chain" in added:
            chains.setdefault(added["chain"]["name"], [])
        elif "rule" in added:
            chains[added["rule"]["chain"]].append(added["rule"]["expr"])
        elif "set" in added or "map" in added:
            elements.setdefault((added.get("set") or added["map"])["name"], [])
        elif "element" in added:
            elements[added["element"]["name"]].extend(added["element"]["elem"])
    return chains, elements


def _left(left, packet: Packet):
    if "meta" in left:
        key = left["meta"]["key"]
        return {"iifname": packet.iif, "oifname": packet.oif, "nfproto": packet.family,
                "l4proto": packet.l4}[key]
    if "payload" in left:
        protocol, name = left["payload"]["protocol"], left["payload"]["field"]
        if protocol in ("ip", "ip6"):
            if packet.family != ("ipv4" if protocol == "ip" else "ipv6"):
                return None  # nftables: a field of another family never matches
            return ipaddress.ip_address(packet.saddr if name == "saddr" else packet.daddr)
        if protocol in ("tcp", "udp") and name == "dport":
            return packet.dport if packet.l4 == protocol else None
        if protocol == "icmpv6" and name == "type":
            return packet.icmpv6_type if packet.l4 == "icmpv6" else None
    if "ct" in left and left["ct"]["key"] == "state":
        return packet.state
    if "fib" in left:
        flags, result = left["fib"]["flags"], left["fib"]["result"]
        if result == "oif" and flags == ["saddr", "iif"]:
            return packet.routed_back
        if result == "type" and flags == ["daddr"]:
            return "local" if packet.local else "unicast"
    if "concat" in left:
        return tuple(_left(part, packet) for part in left["concat"])
    raise Unknown(f"expression {left}")


def _equal(value, right) -> bool:
    if isinstance(right, dict) and "set" in right:
        return any(_equal(value, item) for item in right["set"])
    if isinstance(right, list):  # flags OR-ed together, as nft reads a list for ct state:
        return [value] == right  # `==` is equality with the OR (`in` asks for any of them)
    if isinstance(right, dict) and "prefix" in right:
        network = ipaddress.ip_network(f"{right['prefix']['addr']}/{right['prefix']['len']}")
        return value is not None and value.version == network.version and value in network
    if isinstance(value, ipaddress._BaseAddress) and isinstance(right, str):
        return value == ipaddress.ip_address(right)
    if isinstance(right, str) and isinstance(value, str) and right.endswith("*"):
        return fnmatch.fnmatchcase(value, right)
    return value == right


def _matches(match: dict, packet: Packet, elements: dict[str, list]) -> bool:
    value = _left(match["left"], packet)
    right = match["right"]
    if right == "@learned":
        found = value is not None and None not in value and (
            str(value[0]), str(value[1]), value[2]) in packet.learned
        return found if match["op"] == "==" else not found
    if isinstance(right, str) and right.startswith("@"):  # a named set of prefixes
        right = {"set": elements[right[1:]]}
        if value is None:
            return False
        found = _equal(value, right)
        return found if match["op"] == "==" else not found
    if value is None:
        return False
    if match["op"] == "in" and isinstance(right, list):  # any of these flags
        return value in right
    equal = _equal(value, right)
    return equal if match["op"] in ("==", "in") else not equal


def verdict(commands: list[dict], chain: str, packet: Packet) -> str:
    """accept, drop, reject (naming the deny chain), or redirect:<port> for `chain`."""
    chains, elements = _chains(commands)
    return _walk(chains, elements, chain, packet) or "accept"  # every base chain's policy


def _jump(chains, elements, target: str, packet: Packet) -> str | None:
    if target.startswith("deny_"):  # every deny chain ends in a reject
        return f"reject:{target}"
    return _walk(chains, elements, target, packet)  # a session's chain: None returns


def _walk(chains, elements, chain: str, packet: Packet) -> str | None:
    """The verdict of `chain`, or None when the packet falls off its end."""
    for expr in chains[chain]:
        for statement in expr:
            if "match" in statement:
                if not _matches(statement["match"], packet, elements):
                    break
            elif "accept" in statement:
                return "accept"
            elif "drop" in statement:
                return "drop"
            elif "jump" in statement:
                found = _jump(chains, elements, statement["jump"]["target"], packet)
                if found is not None:
                    return found
                break
            elif "vmap" in statement:  # source subnet -> the session's own chain
                value = _left(statement["vmap"]["key"], packet)
                targets = [v["jump"]["target"] for k, v in elements[
                    statement["vmap"]["data"][1:]] if value is not None and _equal(value, k)]
                assert len(targets) <= 1, targets  # session subnets never overlap
                found = _jump(chains, elements, targets[0], packet) if targets else None
                if found is not None:
                    return found
                break
            elif "redirect" in statement:
                return f"redirect:{statement['redirect']['port']}"
            elif "limit" in statement and statement["limit"].get("inv"):  # "over": a match
                if not packet.flooding:
                    break
            elif "ct count" in statement:
                count = statement["ct count"]
                assert count.get("inv"), count  # only "over" is used
                if packet.connections <= count["val"]:
                    break
            elif not {"counter", "limit", "log"} & set(statement):
                raise Unknown(f"statement {statement}")
    return None
