"""`corral up --backend local` / `corral down`: the appliance's services on this host (root).

The state directory holds everything: the config files (written once, then yours to edit:
`corral up` never overwrites them), the API's certificates, sockets, logs and the services'
state. The services run under a supervisor (`python -m appliance.local`), detached from
this command; `corral down` stops sessions, services and ruleset, in that order.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from appliance import pki

from . import exitcodes, output
from .client import Client, CliError, config_home, load_appliance, write_appliance

BIN = Path(sys.executable).parent
DEFAULT_STATE = Path("/var/lib/corral-local")

CONTAINERS_CONF = """\
# podman for corral's sandboxes on this host. Where PID 1 is not systemd (containers, CI):
# runc, cgroupfs and file events; default ulimits under a low hard RLIMIT_NOFILE.
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
[engine]
runtime = "runc"
cgroup_manager = "{cgroup_manager}"
events_logger = "file"
"""

FILTER = """\
# corral-filter on this host (written by `corral up --backend local`; edit freely).
[dns]
listen = [{dns_listen}]      # every session gateway: the firewall confines each sandbox
upstream = [{upstream}]
[proxy]
listen = ["0.0.0.0:3128"]
transparent_http = ["0.0.0.0:3129"]
transparent_tls = ["0.0.0.0:3130"]
[state]
dir = "{state}/filter"
[control]
socket = "{state}/run/filter.sock"
[firewall]
manage = true
interfaces = ["podman*"]     # podman 4.3 names session bridges podmanN
"""

SANDBOX = """\
[sandbox]
socket = "{state}/run/sandbox.sock"
state_dir = "{state}/sandbox"
filter_socket = "{filter_socket}"
containers_conf = "{state}/containers.conf"
proxy_port = {proxy_port}
"""

API = """\
[api]
listen = "{listen}"
tls_dir = "{state}/api"
control_socket = "{filter_socket}"
sandbox_socket = "{state}/run/sandbox.sock"
pidfile = "{state}/run/api.pid"
"""


def _quote(values: list[str]) -> str:
    return ", ".join(f'"{v}"' for v in values)


def _upstreams() -> list[str]:
    """The host's resolvers, as the filter's upstream (loopback stubs cannot serve it)."""
    found = []
    with contextlib.suppress(OSError):
        for line in Path("/etc/resolv.conf").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver" and not parts[1].startswith("127."):
                found.append(f"{parts[1]}:53")
    return found or ["9.9.9.9:53", "149.112.112.112:53"]


def _prerequisites() -> list[str]:
    missing = []
    if os.geteuid() != 0:
        missing.append("the local backend runs as root: `sudo corral up --backend local`")
    for tool, package in (("nft", "nftables"), ("podman", "podman"), ("runc", "runc"),
                          ("mmdebstrap", "mmdebstrap"), ("iptables", "iptables")):
        if shutil.which(tool) is None:
            missing.append(f"{tool} is missing: apt-get install {package}")
    probe = subprocess.run([sys.executable, "-c", "import nftables"], capture_output=True)
    if probe.returncode != 0:
        missing.append("the nftables Python bindings are missing: apt-get install "
                       "python3-nftables, then scripts/setup links them into .venv")
    return missing


def _write_once(path: Path, text: str) -> bool:
    if path.exists():
        return False
    path.write_text(text)
    return True


def _configure(state: Path, args) -> tuple[str, str]:
    """The config files (kept when present); returns (filter socket, API endpoint)."""
    for sub in ("run", "logs", "api", "filter", "sandbox"):
        (state / sub).mkdir(parents=True, exist_ok=True, mode=0o700)
    systemd = Path("/proc/1/comm").read_text().strip() == "systemd"
    _write_once(state / "containers.conf", CONTAINERS_CONF.format(
        cgroup_manager="systemd" if systemd else "cgroupfs"))
    _write_once(state / "filter.toml", FILTER.format(
        state=state, dns_listen=_quote([args.dns_listen]),
        upstream=_quote(args.upstream or _upstreams())))
    filter_config = tomllib.loads((state / "filter.toml").read_text())
    filter_socket = filter_config["control"]["socket"]
    proxy_port = filter_config["proxy"]["listen"][0].rpartition(":")[2]
    _write_once(state / "sandbox.toml", SANDBOX.format(
        state=state, filter_socket=filter_socket, proxy_port=proxy_port))
    _write_once(state / "api.toml", API.format(state=state, filter_socket=filter_socket,
                                               listen=args.api_listen))
    listen = tomllib.loads((state / "api.toml").read_text())["api"]["listen"]
    return filter_socket, listen


def _supervisor_pid(state: Path) -> int | None:
    try:
        pid = int((state / "supervisor.pid").read_text())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def up(args) -> int:
    missing = _prerequisites()
    if missing:
        raise CliError("cannot bring up the local backend:\n  " + "\n  ".join(missing),
                       "fix the above and run `corral up --backend local` again",
                       exitcodes.NOT_CONFIGURED)
    state = Path(args.state_dir).resolve()
    started = time.monotonic()

    def phase(text):
        output.notice(f"[{time.monotonic() - started:5.1f}s] {text}")

    phase(f"configuring {state}")
    _, listen = _configure(state, args)
    host = listen.rpartition(":")[0].strip("[]")
    directory = config_home() / "appliances" / args.name
    if pki.missing(state / "api", pki.SERVER_FILES) or pki.missing(directory, pki.CLIENT_FILES):
        phase("issuing certificates (the CA key is discarded right after signing)")
        bundle = pki.issue([host])
        pki.write_server(bundle, state / "api")
    else:
        bundle = None
    sudo = [] if "SUDO_UID" not in os.environ else ["sudo"]
    conf = f"CONTAINERS_CONF={state / 'containers.conf'}"
    write_appliance(args.name, listen, bundle, backend="local", state_dir=str(state),
                    server_dir=str(state / "api"), api_pidfile=str(state / "run" / "api.pid"),
                    podman=[*sudo, "env", conf, "podman"],
                    sandbox=[*sudo, str(BIN / "corral-sandbox")])
    _hand_over(directory)
    if not args.no_image:
        phase("sandbox image (built from Debian packages the first time: a few minutes)")
        code = subprocess.call([str(BIN / "corral-sandbox"), "image", "build", "--config",
                                str(state / "sandbox.toml")])
        if code != 0:
            raise CliError("the sandbox image build failed", "see its output above")
    if _supervisor_pid(state):
        phase("the services are already running (`corral down` first to restart them)")
        if bundle is not None:  # new certificates under a running API: it must load them
            with contextlib.suppress(OSError, ValueError):
                os.kill(int((state / "run" / "api.pid").read_text().split()[0]),
                        signal.SIGHUP)
    else:
        phase("starting firewall, filter, sandbox service and API")
        with open(state / "logs" / "supervisor.log", "ab") as log:
            subprocess.Popen([sys.executable, "-m", "appliance.local", "--state-dir",
                              str(state)], stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                             start_new_session=True, cwd="/")
    _wait_for_api(load_appliance(args.name), state, started)
    phase(f"appliance {args.name!r} is up at {listen}")
    output.line(f"""
next:
  corral run --appliance {args.name} --preset pypi      a session for this directory
  corral ls --appliance {args.name}                     sessions and their counters
  corral selftest --appliance {args.name} --allowed H   the bypass battery in a throwaway session
  corral down --appliance {args.name}                   stop everything, remove the ruleset
logs: {state / 'logs'}""")
    return exitcodes.OK


def _hand_over(directory: Path) -> None:
    """Under sudo, the credentials belong to the user who asked, not to root."""
    uid, gid = os.environ.get("SUDO_UID"), os.environ.get("SUDO_GID")
    if uid is None or gid is None:
        return
    for path in [directory, *directory.iterdir()]:
        os.chown(path, int(uid), int(gid))


def _wait_for_api(appliance, state: Path, started: float, timeout: float = 90) -> None:
    client = Client(appliance, timeout=5)
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.request("GET", "/status")
            return
        except CliError as exc:
            problem = exc
        if time.monotonic() > deadline or (
                not _supervisor_pid(state) and time.monotonic() - started > 5):
            tail = ""
            with contextlib.suppress(OSError):
                tail = "\n".join((state / "logs" / "supervisor.log").read_text()
                                 .splitlines()[-15:])
            raise CliError(f"the API did not come up ({problem}):\n{tail}",
                           f"the services' logs are in {state / 'logs'}")
        time.sleep(0.3)


def down(args) -> int:
    appliance = load_appliance(args.appliance)
    if appliance.backend != "local" or appliance.state_dir is None:
        raise CliError(f"appliance {appliance.name} is not a local one",
                       "a VM appliance stops with `vagrant halt` (issue 6)", exitcodes.USAGE)
    pid = _supervisor_pid(appliance.state_dir)
    if pid is None:
        output.line(f"appliance {appliance.name} is not running")
        return exitcodes.OK
    output.notice("stopping sessions, services, then the ruleset ...")
    (appliance.state_dir / "stopped").unlink(missing_ok=True)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 120
    while _supervisor_pid(appliance.state_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _supervisor_pid(appliance.state_dir):
        raise CliError("the supervisor did not stop within 120s",
                       f"see {appliance.state_dir / 'logs' / 'supervisor.log'}")
    outcome = (appliance.state_dir / "stopped").read_text().strip() if (
        appliance.state_dir / "stopped").exists() else "unknown"
    if outcome != "clean":
        raise CliError(f"services stopped, but not cleanly: {outcome}",
                       f"see {appliance.state_dir / 'logs' / 'supervisor.log'}")
    output.line(f"appliance {appliance.name} is down: sessions stopped, services stopped, "
                "ruleset removed")
    return exitcodes.OK
