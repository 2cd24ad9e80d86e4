"""How a sandbox container is started: every hardening flag in one pure function.

Read-only root, a size-limited tmpfs /tmp, no capabilities, no-new-privileges, a non-root
user with the host user's UID/GID inside a user namespace (so that UID is not the host's),
corral's seccomp profile (no namespaces, mounts, keyrings, bpf, perf, userfaultfd: see
seccomp.py), an init as PID 1 that the agent cannot trace (confinement.py), ICMP echo
sockets for the sandbox's groups (so that a ping meets the firewall rather than a missing
capability), memory/pids/cpu limits, no host socket, proxy settings for every tool that
reads its own, trust in the appliance's CAs and its interception CA (trust.py), and DNS
pointed at the session's filter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import sshconf, trust

# Each tool reads its own spelling (curl/pip/requests: both cases; npm: npm_config_*;
# git: http.proxy via GIT_CONFIG_*; Java: JAVA_TOOL_OPTIONS).
NO_PROXY = "localhost,127.0.0.1,::1"
USERNS_SIZE = 65536
"""IDs mapped into a sandbox's user namespace: 0 to 65535 inside."""


@dataclass(frozen=True)
class Sandbox:
    name: str
    """The container's name."""
    image: str
    network: str | None
    """A podman network, or None for no network at all."""
    gateway: str | None
    """The filter's address on that network: DNS and proxy."""
    seccomp_profile: str
    """corral's seccomp profile (confinement.install writes it): required, so that no
    caller can start a sandbox under podman's laxer default by forgetting it."""
    init: str
    """The exec-only init podman runs as PID 1 (confinement.install writes it)."""
    uid: int = 1000
    gid: int = 1000
    proxy_port: int = 3128
    memory: str = "4g"
    pids: int = 2048
    cpus: str = "2"
    tmp_size: str = "1g"
    log_size: str = "1mb"
    """The most of its main process's output podman keeps on the appliance's disk (the
    rest is dropped from the front): an agent's install prints what its package likes."""
    userns_base: int = 200_000
    """Container ID 0 maps to this host ID; USERNS_SIZE IDs are mapped."""
    volumes: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    """(source, target) pairs: the home volume and the workspace."""
    read_only: tuple[tuple[str, str], ...] = ()
    """(source, target) pairs mounted read-only: an agent's installed tree."""
    environment: tuple[tuple[str, str], ...] = ()
    """The session's own variables (an agent's PATH and settings): never over one the
    confinement sets (proxy, trust) or a secret's placeholder."""
    secrets: tuple[tuple[str, str], ...] = ()
    """(variable, placeholder) for each secret the filter holds: never a value."""
    trust: str | None = None
    """The session's trust directory (trust.py), mounted read-only at trust.TRUST_DIR;
    every client stack is pointed at it."""
    ssh: bool = False
    """The trust directory holds an ssh config for the git gateway (sshconf.py), mounted
    as the system's."""
    workdir: str = "/work"


def proxy_environment(gateway: str, port: int) -> dict[str, str]:
    proxy = f"http://{gateway}:{port}"
    return {
        "HTTP_PROXY": proxy, "HTTPS_PROXY": proxy, "http_proxy": proxy, "https_proxy": proxy,
        "ALL_PROXY": proxy, "all_proxy": proxy, "NO_PROXY": NO_PROXY, "no_proxy": NO_PROXY,
        "npm_config_proxy": proxy, "npm_config_https_proxy": proxy,
        "PIP_PROXY": proxy,
        "GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "http.proxy", "GIT_CONFIG_VALUE_0": proxy,
        "JAVA_TOOL_OPTIONS": (f"-Dhttp.proxyHost={gateway} -Dhttp.proxyPort={port} "
                              f"-Dhttps.proxyHost={gateway} -Dhttps.proxyPort={port} "
                              "-Dhttp.nonProxyHosts=localhost|127.0.0.1"),
    }


def run_arguments(s: Sandbox, command: list[str]) -> list[str]:
    """`podman run` arguments for a sandbox (after `run`)."""
    args = [
        "--detach", "--name", s.name, "--hostname", s.name,
        "--read-only", "--read-only-tmpfs=false",
        "--tmpfs", f"/tmp:rw,nosuid,nodev,size={s.tmp_size}",  # noqa: S108 - inside the sandbox
        "--cap-drop=ALL", "--security-opt=no-new-privileges",
        "--security-opt", f"seccomp={s.seccomp_profile}",
        # private IPC: /dev/shm lives in the container's own mount namespace, with no
        # host-side mount to leak into other namespaces (or be shared with anyone)
        "--ipc", "private",
        "--uidmap", f"0:{s.userns_base}:{USERNS_SIZE}",
        "--gidmap", f"0:{s.userns_base}:{USERNS_SIZE}",
        "--user", f"{s.uid}:{s.gid}", "--init", "--init-path", s.init,
        # unprivileged ICMP echo sockets for every group the sandbox has, so that a ping (and
        # the battery's ICMP probe) meets the firewall; the range is written inside the
        # user namespace, so it may only name IDs mapped there
        "--sysctl", f"net.ipv4.ping_group_range=0 {USERNS_SIZE - 1}",
        "--memory", s.memory, "--pids-limit", str(s.pids), "--cpus", s.cpus,
        "--workdir", s.workdir, f"--log-opt=max-size={s.log_size}",
        "--env", "HOME=/home/agent", "--env", "TERM=xterm-256color",
    ]
    environment: dict[str, str] = {}
    if s.network is None:
        args += ["--network", "none"]
    else:
        args += ["--network", s.network]
        if s.gateway:
            args += ["--dns", s.gateway]
            environment = proxy_environment(s.gateway, s.proxy_port)
            if s.trust is not None:
                environment.update(trust.environment())
                environment["JAVA_TOOL_OPTIONS"] += " " + trust.java_options()
            for key, value in s.secrets:  # never over a variable of the session's own
                environment.setdefault(key, value)
    for key, value in s.environment:
        if key not in ("HOME", "TERM"):
            environment.setdefault(key, value)
    for key, value in environment.items():
        args += ["--env", f"{key}={value}"]
    if s.trust is not None:
        args += ["--volume", f"{s.trust}:{trust.TRUST_DIR}:ro"]
        if s.ssh:
            args += ["--volume", f"{s.trust}/{sshconf.CONFIG}:{sshconf.SYSTEM_CONFIG}:ro"]
    for source, target in s.volumes:
        args += ["--volume", f"{source}:{target}:rw"]
    for source, target in s.read_only:
        args += ["--volume", f"{source}:{target}:ro"]
    return [*args, s.image, *command]
