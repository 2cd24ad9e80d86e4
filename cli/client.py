"""Talking to an appliance's admin API: where it is, its credentials, mTLS requests, SSE.

An appliance is a directory under the user's config directory, written by provisioning:

  $XDG_CONFIG_HOME/corral/appliances/<name>/   (0700)
      appliance.toml   endpoint = "127.0.0.1:7443"
                       podman = [...]   the words that run podman on the appliance (terminals)
                       sandbox = [...]  ... and corral-sandbox (image builds)
                       + backend, state_dir, server_dir, api_pidfile for the local backend
      ca.crt  client.crt  client.key (0600)

`--appliance NAME` picks one; the default is "default".
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO
from urllib.parse import urlencode

if TYPE_CHECKING:
    from appliance import pki

CREDENTIALS = ("ca.crt", "client.crt", "client.key")
"""What `corral up` writes for each appliance (appliance.pki's CLIENT_FILES) and every call
presents. Named here so the CLI's start does not import cryptography to read three files."""


class CliError(Exception):
    """An error for a person: what went wrong, and the command that fixes it."""

    def __init__(self, message: str, hint: str = "", code: int = 1):
        super().__init__(message)
        self.hint, self.code = hint, code


def config_home() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "corral"


@dataclass(frozen=True)
class Appliance:
    name: str
    directory: Path
    endpoint: str
    server_dir: Path | None = None
    """The API's TLS directory, when the appliance runs on this host (local backend)."""
    api_pidfile: Path | None = None
    backend: str = "remote"
    """vm (`corral up`), local (`--backend local`), or remote (an inventory host: API only)."""
    state_dir: Path | None = None
    podman: tuple[str, ...] = ("podman",)
    sandbox: tuple[str, ...] = ("corral-sandbox",)

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.endpoint.rpartition(":")
        return host.strip("[]"), int(port)


def known_appliances() -> list[str]:
    """The appliances this host has settings for, by name."""
    return sorted(p.parent.name for p in (config_home() / "appliances").glob("*/appliance.toml"))


def _nonempty(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def load_appliance(name: str, need_credentials: bool = True) -> Appliance:
    """The appliance's settings; with `need_credentials` (the API's client), its client
    certificate too (a VM booted with `corral up --no-provision` has none yet)."""
    from . import exitcodes

    directory = config_home() / "appliances" / name
    settings = directory / "appliance.toml"
    if not settings.is_file():
        known = known_appliances()
        raise CliError(
            f"no appliance {name!r} (no {settings})",
            f"known appliances: {', '.join(known)}" if known else
            "provision one first: `corral up` writes the endpoint and credentials",
            exitcodes.NOT_CONFIGURED)
    try:
        data = tomllib.loads(settings.read_text())
        endpoint = data["endpoint"]
    except (tomllib.TOMLDecodeError, KeyError) as exc:
        raise CliError(f"{settings}: unreadable ({exc})",
                       "re-provision the appliance to rewrite it", exitcodes.NOT_CONFIGURED
                       ) from None
    missing = [f for f in CREDENTIALS if need_credentials and not _nonempty(directory / f)]
    if missing:
        raise CliError(f"appliance {name!r} has no credentials: {', '.join(missing)} missing in "
                       f"{directory}", "provisioning writes them: run `corral provision`",
                       exitcodes.NOT_CONFIGURED)
    def path(key):
        return Path(data[key]) if data.get(key) else None

    words = {k: tuple(data[k]) for k in ("podman", "sandbox") if isinstance(data.get(k), list)}
    return Appliance(name, directory, endpoint, path("server_dir"), path("api_pidfile"),
                     data.get("backend", "remote"), path("state_dir"), **words)


def write_appliance(name: str, endpoint: str, bundle: pki.Bundle | None = None,
                    **extra: str | list[str]) -> Path:
    """What provisioning does on the user's side: credentials and endpoint, private.
    Without a bundle only appliance.toml is (re)written: the credentials stay."""
    directory = config_home() / "appliances" / name
    if bundle is not None:
        from appliance import pki  # cryptography: only where a bundle is written

        pki.write_client(bundle, directory)
    # JSON strings and lists of strings are valid TOML values
    lines = [f"endpoint = {json.dumps(endpoint)}"] + [f"{k} = {json.dumps(v)}"
                                                      for k, v in extra.items()]
    (directory / "appliance.toml").write_text("\n".join(lines) + "\n")
    return directory


SLOW = 600.0
"""Seconds to wait for what takes the appliance long: creating, stopping or removing a
session, its diff and changes, the bypass battery (`timeout=SLOW`)."""


class Client:
    def __init__(self, appliance: Appliance, timeout: float = 10.0):
        self.appliance, self.timeout = appliance, timeout
        context = ssl.create_default_context(cafile=str(appliance.directory / "ca.crt"))
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.load_cert_chain(appliance.directory / "client.crt",
                                appliance.directory / "client.key")
        self.context = context

    def _connection(self, timeout: float | None) -> http.client.HTTPSConnection:
        host, port = self.appliance.host_port
        return http.client.HTTPSConnection(host, port, context=self.context,
                                           timeout=timeout or self.timeout)

    def _failed(self, exc: Exception) -> CliError:
        from . import exitcodes

        where = f"{self.appliance.name} at {self.appliance.endpoint}"
        if isinstance(exc, ssl.SSLError | ssl.CertificateError):
            return CliError(f"TLS with {where} failed: {getattr(exc, 'reason', None) or exc}",
                            "the credentials may be from before a rotation: re-run "
                            "`corral provision` (or `corral certs rotate`)", exitcodes.UNREACHABLE)
        return CliError(f"cannot reach {where}: {getattr(exc, 'strerror', None) or exc}",
                        "is the appliance up? `corral up` starts it; `corral status` checks it",
                        exitcodes.UNREACHABLE)

    def request(self, method: str, path: str, body: dict | None = None, /, *,
                upload: tuple[BinaryIO, int, str] | None = None, timeout: float | None = None,
                **query) -> dict:
        """One API call. `upload` = (file, size, content type) sends a file as the body;
        lists in `query` become repeated arguments."""
        query = {k: v for k, v in query.items() if v is not None}
        url = f"/v1{path}" + (f"?{urlencode(query, doseq=True)}" if query else "")
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        if upload is not None:
            payload, size, kind = upload
            headers = {"Content-Type": kind, "Content-Length": str(size)}
        connection = self._connection(timeout)
        try:
            connection.request(method, url, body=payload, headers=headers)
            response = connection.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as exc:
            raise self._failed(exc) from None
        finally:
            connection.close()
        try:
            answer = json.loads(data)
        except ValueError:
            raise CliError(f"the appliance answered {response.status} with non-JSON") from None
        if response.status >= 400:
            raise CliError(answer.get("error", {}).get("message", f"HTTP {response.status}"),
                           code=3 if response.status == 503 else 1)
        return answer

    def stream(self, path: str, keepalive: bool = False, **query) -> Iterator[dict | None]:
        """Server-Sent Events from the API. Subscribed when it returns (the API answers once
        the subscription is in place): the iterator yields every event after that (and
        None for each keep-alive with `keepalive`), and ends when the stream does."""
        query = {k: v for k, v in query.items() if v is not None}
        connection = self._connection(60.0)
        try:
            connection.request("GET", f"/v1{path}?{urlencode(query)}")
            response = connection.getresponse()
            if response.status != 200:
                answer = json.loads(response.read() or b"{}")
                raise CliError(answer.get("error", {}).get("message", f"HTTP {response.status}"))
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            raise self._failed(exc) from None
        except BaseException:
            connection.close()
            raise
        return EventStream(self, connection, response, keepalive)

    def _events(self, connection, response, keepalive: bool) -> Iterator[dict | None]:
        try:
            data = []
            while True:
                line = response.readline()
                if not line:
                    return
                line = line.rstrip(b"\r\n")
                if line.startswith(b"data:"):
                    data.append(line[5:].strip())
                elif line.startswith(b":") and keepalive:
                    yield None
                elif not line and data:
                    yield json.loads(b"\n".join(data))
                    data = []
        except (OSError, http.client.HTTPException) as exc:
            raise self._failed(exc) from None
        finally:
            connection.close()


class EventStream:
    """An open event stream: iterate it for the events; close() ends it, started or not
    (a generator never started would not run its cleanup)."""

    def __init__(self, client: Client, connection, response, keepalive: bool):
        self.connection = connection
        self._iterator = client._events(connection, response, keepalive)

    def __iter__(self):
        return self._iterator

    def __next__(self):
        return next(self._iterator)

    def close(self) -> None:
        self._iterator.close()
        self.connection.close()
