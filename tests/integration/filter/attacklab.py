"""The attack lab: the real corral-filter in front of real HTTP servers on shared addresses.

Each origin serves an allowed and a denied name on ONE address, as a CDN does, and records
every request it parsed with its own parser:
  127.31.0.5  nginx (HTTP :80, HTTPS :443)  ng-a.test (allowed)  ng-d.test (denied)
  127.31.0.6  Node.js http (llhttp) :80     nd-a.test (allowed)  nd-d.test (denied)
  127.31.0.7  h11 :80                       h1-a.test (allowed)  h1-d.test (denied)
Session s3 (127.0.3.0/24, clients bind 127.0.3.1) may reach the `-a` names and `*.w.test`,
nothing else. A bypass is any record, on any origin, of a request for a `-d` name.

Root only (origins on 80/443); run in a private network namespace:
  unshare -n sh -c 'ip link set lo up; .venv/bin/pytest tests/integration/filter/test_attack_*.py'
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import socketserver
import subprocess
import threading
import time
from pathlib import Path

import h11
import pytest

from tests.integration.conftest import FilterProcess, recv_all

S3_CLIENT = "127.0.3.1"
NGINX, NODE, H11 = "127.31.0.5", "127.31.0.6", "127.31.0.7"
NAMES = {NGINX: ("ng-a.test", "ng-d.test"), NODE: ("nd-a.test", "nd-d.test"),
         H11: ("h1-a.test", "h1-d.test")}
S3_POLICY = """
[http]
allow = ["ng-a.test", "nd-a.test", "h1-a.test", "*.w.test", "rev.test"]
"""

NGINX_CONF = """
daemon off;
master_process off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/nginx-error.log info;
events {{ worker_connections 1024; }}
http {{
    client_body_temp_path {dir}/body; proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fcgi; uwsgi_temp_path {dir}/uwsgi; scgi_temp_path {dir}/scgi;
    log_format rec '$server_name|$host|$request|$http_host|$ssl_server_name';
    access_log {dir}/access.log rec;
    keepalive_requests 1000;
    server {{
        listen {ip}:80 default_server; listen {ip}:443 ssl default_server;
        ssl_certificate {cert}; ssl_certificate_key {key};
        server_name _;
        location / {{ return 200 "vhost=default\\n"; }}
    }}
    server {{
        listen {ip}:80; listen {ip}:443 ssl;
        ssl_certificate {cert}; ssl_certificate_key {key};
        server_name ng-a.test;
        location / {{ return 200 "vhost=ng-a.test\\n"; }}
    }}
    server {{
        listen {ip}:80; listen {ip}:443 ssl;
        ssl_certificate {cert}; ssl_certificate_key {key};
        server_name ng-d.test;
        location / {{ return 200 "vhost=ng-d.test SECRET\\n"; }}
    }}
}}
"""

NODE_SERVER = r"""
const http = require('http');
const fs = require('fs');
const log = process.argv[3];
const server = http.createServer((req, res) => {
  const chunks = [];
  req.on('data', (c) => chunks.push(c));
  req.on('end', () => {
    fs.appendFileSync(log, JSON.stringify({method: req.method, url: req.url,
      host: req.headers.host || null, upgrade: req.headers.upgrade || null,
      connection: req.headers.connection || null,
      body: Buffer.concat(chunks).toString('latin1')}) + '\n');
    res.end('node host=' + req.headers.host + '\n');
  });
});
server.on('clientError', (err, socket) => {
  fs.appendFileSync(log, JSON.stringify({error: String(err.code || err)}) + '\n');
  socket.destroy();
});
server.listen(80, process.argv[2]);
"""


class H11Origin:
    """An origin that reads with h11 and records every request it parsed."""

    def __init__(self, host: str):
        self.requests: list[dict] = []
        self.errors: list[str] = []
        origin = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                origin.serve(self.request)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer((host, 80), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def serve(self, sock: socket.socket) -> None:
        conn = h11.Connection(h11.SERVER)
        sock.settimeout(10)
        current = None
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                self.errors.append(str(exc))
                return
            if event is h11.NEED_DATA:
                try:
                    data = sock.recv(65536)
                except OSError:
                    return
                conn.receive_data(data)
                if not data:
                    return
            elif isinstance(event, h11.Request):
                current = {"method": event.method.decode(), "target": event.target.decode(),
                           "host": dict(event.headers).get(b"host", b"").decode("latin-1"),
                           "body": b""}
            elif isinstance(event, h11.Data):
                current["body"] += event.data
            elif isinstance(event, h11.EndOfMessage):
                current["body"] = current["body"].decode("latin-1")
                self.requests.append(current)
                body = f"h11 host={current['host']}\n".encode()
                try:
                    sock.sendall(conn.send(h11.Response(status_code=200, headers=[
                        ("Content-Length", str(len(body)))])) + conn.send(h11.Data(data=body))
                        + conn.send(h11.EndOfMessage()))
                except (OSError, h11.LocalProtocolError):
                    return
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
            elif isinstance(event, h11.ConnectionClosed):
                return

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Lab:
    """The filter (uvloop) and the three origins."""

    def __init__(self, internet, directory: Path, proxy_extra: str = "", dns_extra: str = ""):
        self.dir = directory
        self.internet = internet
        for address, (allowed, denied) in NAMES.items():
            for name in (allowed, denied):
                internet.dns.zone[name] = [("A", address, 300)]
        internet.dns.zone["rev.test"] = [("A", NGINX, 300)]
        self.processes: list[subprocess.Popen] = []
        # nginx
        ngdir = directory / "nginx"
        ngdir.mkdir()
        internet.ca.server_context(["ng-a.test", "ng-d.test"])
        (ngdir / "nginx.conf").write_text(NGINX_CONF.format(
            dir=ngdir, ip=NGINX, cert=internet.ca.dir / "ng-a.test.pem",
            key=internet.ca.dir / "ng-a.test.key"))
        self.nginx_log = ngdir / "access.log"
        with open(ngdir / "stderr", "wb") as err:
            self.processes.append(subprocess.Popen(["nginx", "-c", str(ngdir / "nginx.conf")],
                                                   stderr=err))
        # node
        self.node_log = directory / "node.jsonl"
        self.node_log.touch()
        (directory / "node.js").write_text(NODE_SERVER)
        with open(directory / "node.stderr", "wb") as err:
            self.processes.append(subprocess.Popen(
                ["node", str(directory / "node.js"), NODE, str(self.node_log)], stderr=err))
        self.h11 = H11Origin(H11)
        for address, port in ((NGINX, 80), (NGINX, 443), (NODE, 80)):
            _wait_port(address, port)
        # the filter, with session s3
        fdir = directory / "filter"
        fdir.mkdir()
        (fdir / "s3.toml").write_text(S3_POLICY)
        self.filter = FilterProcess(fdir, internet.dns.address, extra_config=f"""
[[session]]
name = "s3"
subnet = "127.0.3.0/24"
files = ["{fdir}/s3.toml"]
""", event_loop="uvloop", proxy_extra=proxy_extra, dns_extra=dns_extra)

    # -- what the origins saw ---------------------------------------------------------------

    def nginx_requests(self) -> list[dict]:
        out = []
        for line in self.nginx_log.read_text().splitlines():
            # the request line is raw client bytes (a ClientHello's random may hold "|")
            server, host, rest = line.split("|", 2)
            request, http_host, sni = rest.rsplit("|", 2)
            out.append({"vhost": server, "host": host, "request": request,
                        "http_host": http_host, "sni": sni})
        return out

    def node_requests(self) -> list[dict]:
        return [json.loads(line) for line in self.node_log.read_text().splitlines()]

    def denied_seen(self) -> list[str]:
        """Every request any origin parsed for a denied name: each one is a bypass."""
        seen = []
        for r in self.nginx_requests():
            if r["vhost"] == "ng-d.test" or "ng-d" in r["host"]:
                seen.append(f"nginx: {r}")
        for r in self.node_requests():
            if "nd-d" in (r.get("host") or "") or "nd-d" in r.get("url", ""):
                seen.append(f"node: {r}")
        for r in self.h11.requests:
            if "h1-d" in r["host"] or "h1-d" in r["target"]:
                seen.append(f"h11: {r}")
        return seen

    def mark(self) -> tuple[int, int, int]:
        return (len(self.nginx_requests()), len(self.node_requests()), len(self.h11.requests))

    def close(self):
        self.filter.stop()
        self.h11.close()
        for process in self.processes:
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_port(host: str, port: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), 0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def s3_connect(port: int, timeout: float = 5) -> socket.socket:
    sock = socket.socket()
    sock.settimeout(timeout)
    sock.bind((S3_CLIENT, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def exchange(port: int, data: bytes, timeout: float = 5, settle: float = 0.05) -> bytes:
    """Send `data` on a new connection from s3, half-close, read until the filter closes."""
    sock = s3_connect(port, timeout)
    try:
        sock.sendall(data)
        time.sleep(settle)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
        return recv_all(sock)
    finally:
        sock.close()


def have_tools() -> str | None:
    missing = [t for t in ("nginx", "node") if shutil.which(t) is None]
    return f"missing {', '.join(missing)}" if missing else None


def open_lab(internet, tmp_path_factory):
    """The body of each attack module's `lab` fixture (module scope): a generator."""
    if internet.privileged:
        pytest.skip(internet.privileged)
    if have_tools():
        pytest.skip(have_tools())
    world = Lab(internet, tmp_path_factory.mktemp("lab"))
    yield world
    world.close()
