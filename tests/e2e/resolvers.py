"""Stand-ins for the resolvers a Linux workstation runs, holding port 53 as they do, run in
the appliance namespace before the local backend starts:

  127.0.0.53:53       systemd-resolved's stub (stock Ubuntu and Fedora): UDP and a
                      listening TCP socket, with SO_REUSEADDR as it sets it
  192.168.122.1:53    libvirt's (or NetworkManager's) dnsmasq on its bridge's address

A filter that bound 0.0.0.0:53 could not start next to them (TCP: "Address already in use").
They answer nothing; they only hold the ports, until killed.

  python -m tests.e2e.resolvers DIR      (writes DIR/resolvers-ready once bound)
"""

from __future__ import annotations

import signal
import socket
import sys
from pathlib import Path

HELD = (("127.0.0.53", 53), ("192.168.122.1", 53))


def hold(host: str, port: int) -> list[socket.socket]:
    sockets = []
    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
        sock = socket.socket(socket.AF_INET, kind)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        if kind == socket.SOCK_STREAM:
            sock.listen(16)
        sockets.append(sock)
    return sockets


def main(directory: str) -> None:
    held = [sock for host, port in HELD for sock in hold(host, port)]
    Path(directory, "resolvers-ready").write_text(
        "".join(f"{s.getsockname()[0]}:{s.getsockname()[1]}\n" for s in held))
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    main(sys.argv[1])
