"""The real corral-api (gunicorn, TLS 1.3, client certificates) in front of the real filter."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

from appliance import pki
from cli.client import Appliance, Client, write_appliance
from tests.helpers import stop


class SandboxProcess:
    """The real corral-sandbox on its socket, with its own state directory (it reconciles
    only what it made, so other podman users on this host are safe from it)."""

    def __init__(self, directory: Path, control_socket: Path):
        self.socket = directory / "sandbox.sock"
        self.config = directory / "sandbox.toml"
        self.config.write_text(f"""
[sandbox]
socket = "{self.socket}"
state_dir = "{directory}/sandbox"
filter_socket = "{control_socket}"
""")
        self.log = directory / "sandbox.log"
        exe = Path(sys.executable).parent / "corral-sandbox"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([str(exe), "serve", "--config", str(self.config)],
                                         stdout=log, stderr=log)
        deadline = time.monotonic() + 20
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("corral-sandbox did not come up:\n" + self.log.read_text())
            time.sleep(0.05)

    def stop(self):
        stop(self.proc)


class ApiProcess:
    def __init__(self, directory: Path, control_socket: Path, sandbox_socket: Path | None = None):
        self.dir = directory
        self.server_dir = directory / "server"
        self.bundle = pki.issue(["127.0.0.1"])
        pki.write_server(self.bundle, self.server_dir)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.port = self.listener.getsockname()[1]
        self.pidfile = directory / "api.pid"
        self.config = directory / "api.toml"
        self.config.write_text(f"""
[api]
listen = "fd://{self.listener.fileno()}"
tls_dir = "{self.server_dir}"
control_socket = "{control_socket}"
sandbox_socket = "{sandbox_socket or directory / 'no-sandbox.sock'}"
max_body = 4096
max_upload = 65536
threads = 8
pidfile = "{self.pidfile}"
manifest = "{directory / 'manifest.json'}"
""")
        self.log = directory / "api.log"
        self.start()

    def start(self):
        """Run corral-api on the listening socket this fixture holds (so the port survives)."""
        exe = Path(sys.executable).parent / "corral-api"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([str(exe), "--config", str(self.config)],
                                         pass_fds=[self.listener.fileno()], stdout=log,
                                         stderr=log)
        self.wait_ready()

    def client_dir(self, name="client", bundle=None) -> Path:
        directory = self.dir / name
        pki.write_client(bundle or self.bundle, directory)
        return directory

    def client(self, directory: Path | None = None) -> Client:
        directory = directory or self.client_dir()
        return Client(Appliance("test", directory, f"127.0.0.1:{self.port}",
                                self.server_dir, self.pidfile))

    def wait_ready(self, timeout=20):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("corral-api exited:\n" + self.log.read_text())
            try:
                self.client().request("GET", "/status")
                return
            except Exception:
                time.sleep(0.1)
        raise RuntimeError("corral-api did not come up:\n" + self.log.read_text())

    def terminate(self):
        stop(self.proc)

    def stop(self):
        self.terminate()
        self.listener.close()


@pytest.fixture(scope="module")
def api(corral_filter, tmp_path_factory):
    directory = tmp_path_factory.mktemp("api")
    sandbox = SandboxProcess(directory, corral_filter.socket)
    process = ApiProcess(directory, corral_filter.socket, sandbox.socket)
    process.sandbox = sandbox
    yield process
    process.stop()
    sandbox.stop()


@pytest.fixture(scope="module")
def home(api, tmp_path_factory):
    """A user's config directory holding one provisioned appliance, "default" (the API of
    this module): each module that asks gets its own."""
    directory = tmp_path_factory.mktemp("home")
    os.environ["XDG_CONFIG_HOME"] = str(directory)  # write_appliance reads it
    write_appliance("default", f"127.0.0.1:{api.port}", api.bundle,
                    server_dir=str(api.server_dir), api_pidfile=str(api.pidfile))
    yield directory
    del os.environ["XDG_CONFIG_HOME"]


def tls_client(ca: Path, cert: Path | None = None, key: Path | None = None,
               version=ssl.TLSVersion.TLSv1_3) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    context.minimum_version = context.maximum_version = version
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context
