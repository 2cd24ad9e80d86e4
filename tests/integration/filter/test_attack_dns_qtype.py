"""DNS exfiltration under an allowed wildcard (THREATS 1, issue 14 B11): the exfiltration
guard counts distinct *names* per zone and minute (`exfil_names`), but every (name, type)
pair is a separate upstream query: one name asked with each of the 49 types dnslib knows
(ANY, AXFR, IXFR, HTTPS, SVCB aside) reached whoever serves the zone 49 times, the choice
of type carrying ~5.6 bits each, none of it counted. A type other than A and AAAA now
counts as a name of its own (A and AAAA together count the name once: one bit)."""

from __future__ import annotations

import socket

from dnslib import QTYPE, DNSRecord

from tests.integration.conftest import S1_CLIENT, FilterProcess

LIMIT = 5


def test_types_of_one_name_are_not_counted_by_the_exfiltration_window(internet, tmp_path):
    corral = FilterProcess(tmp_path, internet.dns.address, dns_extra=f"exfil_names = {LIMIT}")
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((S1_CLIENT, 0))
        sock.settimeout(3)
        before = len(internet.dns.queries)
        types = [t for t in QTYPE.forward if t not in (255, 252, 251, 64, 65)][:20]
        for qtype in types:
            sock.sendto(DNSRecord.question("q.wild.test", QTYPE[qtype]).pack(),
                        ("127.0.0.1", corral.dns_port))
            sock.recv(4096)
        sock.close()
        upstream = [q for q in internet.dns.queries[before:] if q[1].endswith("wild.test")]
        assert len(upstream) <= LIMIT + 1, (  # A and AAAA of one name: one entry
            f"{len(upstream)} upstream queries under *.wild.test in well under a minute "
            f"(exfil_names = {LIMIT}): {sorted({q[2] for q in upstream})}")
    finally:
        corral.stop()
