"""What a session trusts: the appliance's CA bundle and the filter's interception CA.

Each session gets a directory of its own, mounted read-only at TRUST_DIR:

  ca-bundle.crt   the image's own system bundle, then the interception CA (PEM)
  cacerts.jks     the same certificates as a JKS trust store, for the JVM

The image points the system bundle (/etc/ssl/certs/ca-certificates.crt) at TRUST_DIR's (and
keeps a copy of Debian's there, under the mount, for what runs without it: a team's image
build), and `environment()` points every client stack that reads its own setting there too,
so curl, git, OpenSSL, Python (urllib, requests, pip), node and npm, Go and Java trust an
inspected host's leaf certificate without the agent doing anything. Files are replaced by
rename in a mounted directory, so a refresh (after `corral certs rotate --interception`)
reaches running sessions: the processes started after it.

The bundle starts from the image's (read once per image by the session manager), so a CA a
team's image layer adds with update-ca-certificates is trusted as before.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import struct
import time
from pathlib import Path

from appliance.atomic import write_atomic

TRUST_DIR = "/etc/corral/trust"
"""Where the directory is mounted inside a session."""
BUNDLE, JKS = "ca-bundle.crt", "cacerts.jks"
SYSTEM_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
"""Debian's, in the image and on the appliance."""
JKS_PASSWORD = "changeit"  # noqa: S105 - public by convention, guards no secret
"""The JDK's conventional trust store password: `keytool -list` checks the store's digest
with it; the JVM reads a trust store without one (javax.net.ssl.trustStorePassword unset)."""
CORRAL_ALIAS = "corral-interception-ca"
PEM_BLOCK = re.compile(rb"-----BEGIN CERTIFICATE-----\s*(.+?)\s*-----END CERTIFICATE-----",
                       re.S)


def environment() -> dict[str, str]:
    """The settings each client stack reads its trust from, all at TRUST_DIR."""
    bundle = f"{TRUST_DIR}/{BUNDLE}"
    return {
        "SSL_CERT_FILE": bundle,            # OpenSSL (and Python's ssl), Go
        "REQUESTS_CA_BUNDLE": bundle,       # requests
        "CURL_CA_BUNDLE": bundle,           # curl
        "PIP_CERT": bundle,                 # pip
        "GIT_SSL_CAINFO": bundle,           # git
        "NODE_EXTRA_CA_CERTS": bundle,      # node and npm: added to node's own roots
        "npm_config_cafile": bundle,
    }


def java_options() -> str:
    """For JAVA_TOOL_OPTIONS: the JVM's trust store (it reads no PEM bundle)."""
    return (f"-Djavax.net.ssl.trustStore={TRUST_DIR}/{JKS} "
            "-Djavax.net.ssl.trustStoreType=JKS")


def certificates(pem: bytes) -> list[bytes]:
    """The DER certificates of a PEM bundle, in order (what is not a certificate block is
    skipped, as OpenSSL does)."""
    out = []
    for match in PEM_BLOCK.finditer(pem):
        try:
            out.append(base64.b64decode(b"".join(match.group(1).split()), validate=True))
        except ValueError:
            continue
    return out


def jks(entries: list[tuple[str, bytes]], when: float | None = None) -> bytes:
    """A JKS trust store of (alias, DER certificate) entries, as the JDK's JavaKeyStore
    writes one: magic, version 2, each entry a trusted certificate, then the SHA-1 keyed
    with JKS_PASSWORD. Aliases are lower case (the JDK folds them)."""
    stamp = int((time.time() if when is None else when) * 1000)

    def utf(text: str) -> bytes:
        data = text.encode()  # ASCII aliases: modified UTF-8 is UTF-8
        return struct.pack(">H", len(data)) + data

    out = bytearray(struct.pack(">III", 0xFEEDFEED, 2, len(entries)))
    for alias, der in entries:
        out += struct.pack(">I", 2) + utf(alias.lower()) + struct.pack(">q", stamp)
        out += utf("X.509") + struct.pack(">I", len(der)) + der
    digest = hashlib.sha1(usedforsecurity=False)
    digest.update(JKS_PASSWORD.encode("utf-16-be"))
    digest.update(b"Mighty Aphrodite")  # the JDK's own constant
    digest.update(out)
    return bytes(out) + digest.digest()


def write(directory: Path, ca_pem: str | None, base: bytes) -> None:
    """The session's trust directory: the image's bundle `base` plus `ca_pem` (None:
    inspection is off, the bundle alone). Each file is replaced by rename; the directory and
    files are readable by the sandbox's mapped user."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o755)  # noqa: S103 - certificates, read by the sandbox's user
    bundle = base.rstrip(b"\n") + b"\n" if base.strip() else b""
    extra = ca_pem.encode() if ca_pem else b""
    if extra:
        bundle += b"# corral interception CA\n" + extra.rstrip(b"\n") + b"\n"
    entries = [(f"system-{i}", der) for i, der in enumerate(certificates(base))]
    entries += [(CORRAL_ALIAS, der) for der in certificates(extra)]
    write_atomic(directory / BUNDLE, bundle, mode=0o644)
    write_atomic(directory / JKS, jks(entries), mode=0o644)
