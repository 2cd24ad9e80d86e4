"""`corral-api`'s config file (TOML). Parsed whole before anything starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from appliance.policy import ConfigError, split_host_port
from appliance.settings import load_table, non_empty, positive


@dataclass(frozen=True)
class ApiConfig:
    listen: str = "127.0.0.1:7443"
    """host:port (or fd://N, as gunicorn takes it)."""
    tls_dir: str = "/etc/corral/api"
    """Holds ca.crt, server.crt and server.key (see appliance.pki)."""
    control_socket: str = "/run/corral-filter/control.sock"
    """The filter's control socket (corral_filter_control_socket, as the role sets it)."""
    sandbox_socket: str = "/run/corral-sandbox/control.sock"
    """The sandbox service (sessions); empty: this appliance has none."""
    max_body: int = 16 * 1024
    """Largest JSON body accepted; larger gets 413."""
    max_upload: int = 512 * 1024 * 1024
    """Largest project archive or applied changeset accepted."""
    threads: int = 16
    """Worker threads: each live `monitor` stream holds one."""
    pidfile: str = ""
    """Where gunicorn writes its pid (SIGHUP there reloads the certificates); none if empty."""
    manifest: str = "/etc/corral/manifest.json"
    """The appliance's manifest (provisioning writes it), served as GET /v1/manifest; an
    evidence bundle carries its digest, or says it is absent."""

    @property
    def tls(self) -> Path:
        return Path(self.tls_dir)


def load(path: str) -> ApiConfig:
    config, where = load_table(path, "api", ApiConfig)
    non_empty(path, "api", config, where, "listen", "tls_dir", "control_socket")
    positive(path, "api", config, where, "max_body", "max_upload", "threads")
    if not config.listen.startswith("fd://"):
        _, port = split_host_port(config.listen)
        if not port or not port.isdigit():
            raise ConfigError(path, "[api] listen", f"{config.listen!r} needs host:port",
                              where.key("api", "listen"))
    return config
