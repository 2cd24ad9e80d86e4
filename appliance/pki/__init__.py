"""The appliance's certificates.

The control plane's: an ephemeral Ed25519 CA, one server and one client cert. The CA's
private key exists only inside `issue()`: it signs the two certificates and is dropped when
the function returns; it is never serialised. So nothing can mint another client certificate
later, and rotating means issuing a whole new set: the server then trusts only the new CA,
and every old client certificate stops working.

The filter's TLS interception CA (`intercept_ca()`): the one CA whose key is kept, because
the filter signs a leaf certificate with it for each inspected host on first use. It is
ECDSA P-256 (every client stack accepts it), may sign end-entity certificates only
(pathlen 0), and lives half a year; its key file is 0600 for the filter's user alone.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from appliance.atomic import fsync_dir
from appliance.policy import normalise_name

log = logging.getLogger(__name__)

VALIDITY = datetime.timedelta(days=825)
SERVER_FILES = ("ca.crt", "server.crt", "server.key")
CLIENT_FILES = ("ca.crt", "client.crt", "client.key")
INTERCEPT_FILES = ("intercept-ca.crt", "intercept-ca.key")
INTERCEPT_DAYS = 180
"""The interception CA's default lifetime: short, since whoever holds its key can read every
inspected session's traffic. The filter makes its own (`CaDirectory`) and a new one on
`corral certs rotate`; `python -m appliance.pki intercept-ca` makes one by hand."""
CURRENT = "current"
"""In a CA directory: the symlink naming the generation in use."""


@dataclass(frozen=True)
class Bundle:
    """One issued set, as PEM bytes. The CA key is not in it: it no longer exists."""

    ca_cert: bytes
    server_cert: bytes
    server_key: bytes
    client_cert: bytes
    client_key: bytes


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "corral"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ed25519.Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _sign(subject, public_key, issuer, ca_key, now, *, ca=False, sans=None, usage=None):
    # The key identifiers are what RFC 5280 asks of every certificate: OpenSSL's strict
    # verification (Python 3.13's default, Debian 13's interpreter) refuses a chain without
    # the Authority Key Identifier ("Missing Authority Key Identifier").
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
               .public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + VALIDITY)
               .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None),
                              critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key),
                              critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                   ca_key.public_key()), critical=False))
    builder = builder.add_extension(x509.KeyUsage(
        digital_signature=not ca, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=ca, crl_sign=ca,
        encipher_only=False, decipher_only=False), critical=True)
    if not ca:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=True)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, None).public_bytes(serialization.Encoding.PEM)


def issue(addresses: list[str] = ("127.0.0.1",), names: list[str] = ()) -> Bundle:
    """A fresh CA, a server certificate for `addresses` and `names`, a client certificate."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ed25519.Ed25519PrivateKey.generate()
    ca_name = _name(f"corral ephemeral CA {now:%Y-%m-%d %H:%M:%S}")
    ca_cert = _sign(ca_name, ca_key.public_key(), ca_name, ca_key, now, ca=True)
    sans = [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
    sans += [x509.DNSName(n) for n in names]
    server_key = ed25519.Ed25519PrivateKey.generate()
    server_cert = _sign(_name("corral-api"), server_key.public_key(), ca_name, ca_key, now,
                        sans=sans, usage=ExtendedKeyUsageOID.SERVER_AUTH)
    client_key = ed25519.Ed25519PrivateKey.generate()
    client_cert = _sign(_name("corral-cli"), client_key.public_key(), ca_name, ca_key, now,
                        usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    del ca_key  # the only reference: nothing can sign with this CA again
    return Bundle(ca_cert, server_cert, _pem_key(server_key), client_cert, _pem_key(client_key))


def intercept_ca(days: int = INTERCEPT_DAYS, permit: Iterable[str] = ()) -> tuple[bytes, bytes]:
    """A new interception CA: (certificate PEM, private key PEM).

    With `permit`, the CA is name-constrained (critical nameConstraints) to those DNS names
    and their subdomains, and to no IP address at all: a client that checks constraints
    (OpenSSL, Go, NSS, the JVM, browsers) refuses any leaf it signs for another name, so a
    stolen key reads only those hosts' traffic. Without it the CA is unconstrained: the
    inspected hosts are chosen at run time by the policy, not when the CA is made."""
    if days <= 0:
        raise ValueError("--days must be at least 1")
    names = [normalise_name(name) for name in permit]  # raises HostNameError (ValueError)
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(f"corral interception CA {now:%Y-%m-%d %H:%M:%S}")
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(
                   digital_signature=False, content_commitment=False, key_encipherment=False,
                   data_encipherment=False, key_agreement=False, key_cert_sign=True,
                   crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                              critical=False))
    if names:
        builder = builder.add_extension(x509.NameConstraints(
            permitted_subtrees=[x509.DNSName(n) for n in names],
            excluded_subtrees=[x509.IPAddress(ipaddress.ip_network("0.0.0.0/0")),
                               x509.IPAddress(ipaddress.ip_network("::/0"))]), critical=True)
    cert = builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
    return cert, key.private_bytes(serialization.Encoding.PEM,
                                   serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption())


def write_intercept_ca(cert: bytes, key: bytes, directory: Path) -> None:
    _write(Path(directory), dict(zip(INTERCEPT_FILES, (cert, key), strict=True)))


class CaDirectory:
    """The filter's own interception CA (`[inspect] ca_dir`): made on its first start,
    replaced by `rotate()`. Each pair is written into a generation directory of its own and
    DIR/current, a symlink, is swapped to it in one rename: a crash mid-rotation leaves the
    old pair or the new one in use, never a certificate with another pair's key. The
    directory is the filter user's alone (0700; keys 0600)."""

    def __init__(self, directory: str | Path):
        self.path = Path(directory)

    @property
    def cert(self) -> Path:
        return self.path / CURRENT / INTERCEPT_FILES[0]

    @property
    def key(self) -> Path:
        return self.path / CURRENT / INTERCEPT_FILES[1]

    def exists(self) -> bool:
        return not missing(self.path / CURRENT, INTERCEPT_FILES)

    def ensure(self) -> bool:
        """Make a CA unless one is in use; True if it made one."""
        if self.exists():
            return False
        self.rotate()
        return True

    def rotate(self, days: int = INTERCEPT_DAYS) -> None:
        """A new CA in a new generation, then `current` moved to it; older generations go."""
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.path, 0o700)
        cert, key = intercept_ca(days)
        generation = Path(tempfile.mkdtemp(dir=self.path, prefix="ca-"))  # mode 0700
        write_intercept_ca(cert, key, generation)
        fsync_dir(generation)
        link = self.path / f".{CURRENT}.{generation.name}"
        os.symlink(generation.name, link)
        os.replace(link, self.path / CURRENT)
        fsync_dir(self.path)
        self._clean(keep=generation.name)

    def _clean(self, keep: str) -> None:
        """Older generations (their keys with them) and links a crash left: only what
        `rotate` makes. The new CA is in use already: a leftover is logged, never raised."""
        for old in self.path.iterdir():
            try:
                if old.name.startswith(f".{CURRENT}.") and old.is_symlink():
                    old.unlink()
                elif (old.name.startswith("ca-") and old.name != keep and old.is_dir()
                      and not old.is_symlink()):
                    for child in old.iterdir():
                        child.unlink()
                    old.rmdir()
            except OSError as exc:
                log.warning("pki: could not remove %s: %s", old, exc)


def _write(directory: Path, files: dict[str, bytes]) -> None:
    """Each file atomically (temp, fsync, rename); keys 0600 from birth; directory 0700."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
    for name, data in files.items():
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")  # mkstemp: mode 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if not name.endswith(".key"):
                os.chmod(tmp, 0o644)
            os.replace(tmp, directory / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def write_server(bundle: Bundle, directory: Path) -> None:
    _write(Path(directory), {"ca.crt": bundle.ca_cert, "server.crt": bundle.server_cert,
                             "server.key": bundle.server_key})


def write_client(bundle: Bundle, directory: Path) -> None:
    _write(Path(directory), {"ca.crt": bundle.ca_cert, "client.crt": bundle.client_cert,
                             "client.key": bundle.client_key})


def missing(directory: Path, files: tuple[str, ...]) -> list[str]:
    """Which of `files` are absent or empty in `directory`."""
    return [f for f in files if not (Path(directory) / f).is_file()
            or (Path(directory) / f).stat().st_size == 0]


def main(argv: list[str] | None = None) -> int:
    """`python -m appliance.pki issue`: what the corral_pki role runs on the control machine.
    The client side goes where the CLI reads it; the server side to a directory the role
    copies into the appliance and then deletes.

    `python -m appliance.pki intercept-ca --out DIR`: the filter's interception CA, written
    as DIR/intercept-ca.crt and DIR/intercept-ca.key (0600; DIR 0700)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m appliance.pki",
                                     description="The appliance's certificates.")
    commands = parser.add_subparsers(dest="command", required=True)
    issue_cmd = commands.add_parser("issue", description="Issue a new control-plane "
                                    "certificate set (the CA key is discarded right after "
                                    "signing).")
    issue_cmd.add_argument("--server-dir", required=True, type=Path)
    issue_cmd.add_argument("--client-dir", required=True, type=Path)
    issue_cmd.add_argument("--address", action="append", default=[], metavar="IP",
                           help="an address the API is reached at (repeatable)")
    issue_cmd.add_argument("--name", action="append", default=[], metavar="DNS",
                           help="a DNS name the API is reached at (repeatable)")
    ca_cmd = commands.add_parser("intercept-ca", description="Make the filter's TLS "
                                 "interception CA (ECDSA P-256, pathlen 0).")
    ca_cmd.add_argument("--out", required=True, type=Path, help="the directory to write to")
    ca_cmd.add_argument("--days", type=int, default=INTERCEPT_DAYS,
                        help=f"how long it is valid (default {INTERCEPT_DAYS})")
    ca_cmd.add_argument("--permit", action="append", default=[], metavar="NAME",
                        help="constrain the CA to this DNS name and its subdomains "
                        "(repeatable; without it the CA is unconstrained)")
    args = parser.parse_args(argv)
    if args.command == "intercept-ca":
        try:
            cert, key = intercept_ca(args.days, args.permit)
        except ValueError as exc:
            parser.error(str(exc))
        write_intercept_ca(cert, key, args.out)
        print(f"interception CA written to {args.out}")
        return 0
    try:
        bundle = issue(args.address or ["127.0.0.1"], args.name)
    except ValueError as exc:
        parser.error(str(exc))
    write_server(bundle, args.server_dir)
    write_client(bundle, args.client_dir)
    print(f"issued: server side in {args.server_dir}, client side in {args.client_dir}")
    return 0

