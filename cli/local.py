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

from . import exitcodes, output, roles
from .client import Client, CliError, config_home, load_appliance, write_appliance

BIN = Path(sys.executable).parent
DEFAULT_STATE = Path("/var/lib/corral-local")

RESOLV_CONFS = (Path("/run/systemd/resolve/resolv.conf"), Path("/etc/resolv.conf"))
"""Where the host's resolvers are: systemd-resolved's list of its upstreams where it runs
(its /etc/resolv.conf names only its loopback stub), else /etc/resolv.conf."""
FILTER_CONFIGS = (("corral_filter", "filter.toml"), ("corral_filter", "policy.toml"))
OTHER_CONFIGS = (("corral_sandbox", "containers.conf"), ("corral_sandbox", "sandbox.toml"),
                 ("corral_api", "api.toml"))
"""The roles' config templates the local backend writes into its state directory: the
filter's first, as the others name its socket and port."""


def _systemd() -> bool:
    try:
        return Path("/proc/1/comm").read_text().strip() == "systemd"
    except OSError:
        return False


def resolv_conf() -> Path:
    return next((path for path in RESOLV_CONFS if path.exists()), RESOLV_CONFS[-1])


def values(state: Path, *, api_listen: str = "127.0.0.1:7443",
           upstream: list[str] | None = None, systemd: bool | None = None) -> dict:
    """The roles' defaults with what differs on this host: everything under the state
    directory, no control group (root alone uses the sockets), the host's resolvers (read at
    each filter start, as on an appliance) unless `upstream` names them, podman's cgroup
    manager for this PID 1. The filter listens on the sessions' gateways only, as on an
    appliance: the host's own resolvers (systemd-resolved on 127.0.0.53:53, dnsmasq on
    libvirt's or NetworkManager's addresses) keep their port 53."""
    return {
        **roles.defaults(),
        "ansible_managed": "written once by `corral up --backend local`: yours to edit, "
                           "never overwritten",
        "corral_base_control_group": "",
        "corral_filter_upstream": list(upstream or []),
        "corral_filter_resolv_conf": str(resolv_conf()),
        "corral_filter_state_dir": str(state / "filter"),
        "corral_filter_inspect_ca_dir": str(state / "filter" / "intercept"),
        "corral_filter_control_socket": str(state / "run" / "filter.sock"),
        "corral_filter_journal": False,  # events stay in the state directory's audit log
        "corral_sandbox_control_socket": str(state / "run" / "sandbox.sock"),
        "corral_sandbox_state_dir": str(state / "sandbox"),
        "corral_sandbox_cgroup_manager": "systemd" if (
            _systemd() if systemd is None else systemd) else "cgroupfs",
        "corral_api_listen": api_listen,
        "corral_api_tls_dir": str(state / "api"),
        "corral_api_pidfile": str(state / "run" / "api.pid"),
    }


def containers_conf(directory: Path) -> str:
    """podman's config for corral's sandboxes on this host (the role's template)."""
    return roles.render("corral_sandbox", "etc/corral/containers.conf.j2",
                        values(directory), config_dir=str(directory))


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
    """Write `path` (atomically) unless it exists: a kept file is the user's."""
    if path.exists():
        return False
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)
    return True


def _configure(state: Path, args) -> tuple[str, str]:
    """The config files, rendered from the roles' templates (kept when present); returns
    (filter socket, API endpoint)."""
    for sub in ("run", "logs", "api", "filter", "sandbox"):
        (state / sub).mkdir(parents=True, exist_ok=True, mode=0o700)
    settings = values(state, api_listen=args.api_listen, upstream=args.upstream)
    kept = [name for role, name in FILTER_CONFIGS if _render(state, role, name, settings)]
    _check_filter(state / "filter.toml")
    settings.update(_filter_endpoints(state / "filter.toml", settings))
    kept += [name for role, name in OTHER_CONFIGS if _render(state, role, name, settings)]
    if kept:
        output.notice(f"kept {', '.join(kept)} as found in {state}: yours to edit (remove one "
                      "to have it written anew from the roles' templates)")
    listen = tomllib.loads((state / "api.toml").read_text())["api"]["listen"]
    return settings["corral_filter_control_socket"], listen


def _render(state: Path, role: str, name: str, settings: dict) -> bool:
    """Write the role's template for `name` unless the file is there; True if a kept file
    differs from what would be written now."""
    text = roles.render(role, f"etc/corral/{name}.j2", settings, config_dir=str(state))
    return not _write_once(state / name, text) and (state / name).read_text() != text


def _filter_endpoints(path: Path, settings: dict) -> dict:
    """The control socket and proxy port of the filter config as it is on disk (a kept one
    may have moved them; the filter's loader has read it already)."""
    config = tomllib.loads(path.read_text())
    socket = config.get("control", {}).get("socket", settings["corral_filter_control_socket"])
    listen = config.get("proxy", {}).get("listen", [])
    port = int(listen[0].rpartition(":")[2]) if listen else settings["corral_filter_proxy_port"]
    return {"corral_filter_control_socket": socket, "corral_filter_proxy_port": port}


def _check_filter(path: Path) -> None:
    """The filter's own loader reads the config before anything starts: a config it would
    refuse (a host without a usable resolver, above all) fails here, saying how to fix it."""
    result = subprocess.run([str(BIN / "corral-filter"), "--config", str(path), "--check"],
                            capture_output=True, text=True)
    if result.returncode == 0:
        return
    problem = (result.stderr or result.stdout).strip()
    if "upstream_from" in problem:
        raise CliError(f"no DNS resolver for the filter: {problem}",
                       "name the resolvers the filter forwards allowed names to: `corral up "
                       "--backend local --upstream IP:PORT` (remove "
                       f"{path} first if it was written before), or set [dns] upstream in it",
                       exitcodes.NOT_CONFIGURED)
    raise CliError(f"{path} does not load: {problem}",
                   "fix it (it is yours to edit), or remove it to have it written anew",
                   exitcodes.NOT_CONFIGURED)


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
