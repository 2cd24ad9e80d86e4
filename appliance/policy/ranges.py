"""Address ranges the proxy and the DNS filter refuse unless the policy names them.

DESIGN invariant 3: RFC 1918, loopback, link-local (cloud metadata lives there), CGNAT,
0/8, ULA, and the v6 forms that smuggle an IPv4 address (judged by what they carry).
"""

from __future__ import annotations

import ipaddress

from .names import IPAddress, unmap

BLOCKED_V4 = tuple(
    ipaddress.IPv4Network(n)
    for n in (
        "0.0.0.0/8",  # "this network"; 0.0.0.0 reaches the local host on Linux
        "10.0.0.0/8",
        "100.64.0.0/10",  # CGNAT
        "127.0.0.0/8",
        "169.254.0.0/16",  # link-local, including metadata 169.254.169.254
        "172.16.0.0/12",
        "192.0.0.0/24",  # IETF protocol assignments
        "192.168.0.0/16",
        "198.18.0.0/15",  # benchmarking, used by some NAT appliances internally
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved and broadcast
    )
)

BLOCKED_V6 = tuple(
    ipaddress.IPv6Network(n)
    for n in (
        "::/128",
        "::1/128",
        "::/96",  # deprecated v4-compatible
        "64:ff9b::/96",  # NAT64: reaches the embedded IPv4 address
        "64:ff9b:1::/48",
        "100::/64",  # discard
        "2001:db8::/32",  # documentation
        "2002::/16",  # 6to4: reaches the embedded IPv4 address
        "fc00::/7",  # unique local
        "fe80::/10",  # link-local
        "fec0::/10",  # site-local (deprecated)
        "ff00::/8",  # multicast
    )
)


def blocked_range(address: IPAddress) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    """The blocked network `address` falls into, or None when it is an ordinary address."""
    address = unmap(address)
    networks = BLOCKED_V4 if address.version == 4 else BLOCKED_V6
    for network in networks:
        if address in network:
            return network
    return None
