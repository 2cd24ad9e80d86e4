"""`corral-api --config FILE`: the admin API under gunicorn, mTLS with TLS 1.3 only.

It refuses to start without its key material (exit 2, naming the missing files). One
process with threads (gthread): a live event stream holds a thread, not a process.
"""

from __future__ import annotations

import argparse
import ssl
import sys

from gunicorn.app.base import BaseApplication

from appliance import pki
from appliance.policy import ConfigError

from . import create_app
from .config import ApiConfig, load


def tls13_only(conf, default_ssl_context_factory):
    """gunicorn's hook: its default context (our cert, CA, CERT_REQUIRED), raised to TLS 1.3."""
    context = default_ssl_context_factory()
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_mode = ssl.CERT_REQUIRED
    return context


class Server(BaseApplication):
    def __init__(self, config: ApiConfig):
        self.config = config
        super().__init__()

    def load_config(self) -> None:
        tls = self.config.tls
        options = {
            "bind": [self.config.listen],
            "workers": 1,
            "worker_class": "gthread",
            "threads": self.config.threads,
            "certfile": str(tls / "server.crt"),
            "keyfile": str(tls / "server.key"),
            "ca_certs": str(tls / "ca.crt"),
            "cert_reqs": ssl.CERT_REQUIRED,
            "ssl_context": tls13_only,
            "accesslog": "-",
            "graceful_timeout": 5,
            # gunicorn's most (its default is 4094): an agent's profile rides in the query of
            # a project upload (the body is the archive); the shipped ones take ~1.2 KB
            "limit_request_line": 8190,
            "proc_name": "corral-api",
        }
        if self.config.pidfile:
            options["pidfile"] = self.config.pidfile
        for key, value in options.items():
            self.cfg.set(key, value)

    def load(self):
        return create_app(self.config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="corral-api", description="corral's admin API "
                                     "(mTLS, TLS 1.3 only), in front of the filter.")
    parser.add_argument("--config", required=True, metavar="FILE")
    args = parser.parse_args(argv)
    try:
        config = load(args.config)
    except ConfigError as exc:
        print(f"corral-api: {exc}", file=sys.stderr)
        return 2
    missing = pki.missing(config.tls, pki.SERVER_FILES)
    if missing:
        print(f"corral-api: refusing to start without key material: {', '.join(missing)} "
              f"missing in {config.tls}; provisioning writes them (appliance.pki)",
              file=sys.stderr)
        return 2
    Server(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
