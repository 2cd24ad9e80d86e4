"""`corral-api`'s config file (TOML). Parsed whole before anything starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from appliance.policy import ConfigError, parse_toml, split_host_port
from appliance.policy.config import Locator

KEYS = {"listen", "tls_dir", "control_socket", "max_body", "threads", "pidfile"}


@dataclass(frozen=True)
class ApiConfig:
    listen: str = "127.0.0.1:7443"
    """host:port (or fd://N, as gunicorn takes it)."""
    tls_dir: str = "/etc/corral/api"
    """Holds ca.crt, server.crt and server.key (see appliance.pki)."""
    control_socket: str = "/run/corral/filter.sock"
    max_body: int = 16 * 1024
    """Largest request body accepted; larger gets 413."""
    threads: int = 16
    """Worker threads: each live `monitor` stream holds one."""
    pidfile: str = ""
    """Where gunicorn writes its pid (SIGHUP there reloads the certificates); none if empty."""

    @property
    def tls(self) -> Path:
        return Path(self.tls_dir)


def load(path: str) -> ApiConfig:
    try:
        text = Path(path).read_text("utf-8")
    except OSError as exc:
        raise ConfigError(path, "", f"cannot read: {exc.strerror}") from None
    data = parse_toml(text, path)
    where = Locator(text)
    for key in data:
        if key != "api":
            raise ConfigError(path, key, "unknown key; expected [api]", where.key("", key))
    api = data.get("api", {})
    for key in api:
        if key not in KEYS:
            raise ConfigError(path, f"[api] {key}", f"unknown key; expected "
                              f"{', '.join(sorted(KEYS))}", where.key("api", key))
    config = ApiConfig(**api)
    if not isinstance(config.pidfile, str):
        raise ConfigError(path, "[api] pidfile", "must be a string", where.key("api", "pidfile"))
    for key in ("listen", "tls_dir", "control_socket"):
        if not isinstance(getattr(config, key), str) or not getattr(config, key):
            raise ConfigError(path, f"[api] {key}", "must be a non-empty string",
                              where.key("api", key))
    for key in ("max_body", "threads"):
        value = getattr(config, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(path, f"[api] {key}", f"must be a positive whole number, got "
                              f"{value!r}", where.key("api", key))
    if not config.listen.startswith("fd://"):
        _, port = split_host_port(config.listen)
        if not port or not port.isdigit():
            raise ConfigError(path, "[api] listen", f"{config.listen!r} needs host:port",
                              where.key("api", "listen"))
    return config
