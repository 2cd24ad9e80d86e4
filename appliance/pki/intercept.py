"""The interception CA and the leaves it signs: loading it (with the names its
nameConstraints permit), minting a leaf certificate for one host, and the TLS context that
serves a leaf. Blocking and pure of sockets: the filter mints on a worker thread, caches
leaves and limits each session's mints (filter/proxy/inspect.py); `CaDirectory` (this
package) makes and rotates the CA these load.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import ssl
import stat
import tempfile
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from appliance.policy import ConfigError, Host

ALPN = ["http/1.1"]
"""What both sides are offered: requests are judged as HTTP/1.x. A client that insists on
HTTP/2 gets no ALPN answer and falls back, or fails: it is never tunnelled instead."""
LEAF_LIFETIME = datetime.timedelta(days=3)
LEAF_BACKDATE = datetime.timedelta(hours=1)
"""A leaf is valid from an hour ago (clients whose clocks run a little behind)..."""
LEAF_REUSE = 24 * 3600.0
"""... and used for a day after it was minted, then minted again: never near its end."""


class Unusable(ConfigError):
    """A CA that can never sign anything a client accepts (damaged, mismatched, expired):
    the filter's own (`ca_dir`) is replaced; one that is not valid *yet* (a clock behind)
    or cannot be read now is kept, and the error stands."""


@dataclass(frozen=True)
class Authority:
    """The interception CA: what leaves are signed with."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
    permitted: tuple[str, ...] | None
    """The DNS names its nameConstraints permit (with their subdomains), None when
    unconstrained: a leaf for any other name would be refused by the client."""
    key_id: x509.AuthorityKeyIdentifier

    @classmethod
    def load(cls, cert_path: str, key_path: str, now: datetime.datetime | None = None
             ) -> Authority:
        """Read and check the CA files. Raises ConfigError naming the file at fault."""
        now = now or datetime.datetime.now(datetime.UTC)
        try:
            cert = x509.load_pem_x509_certificate(_read(cert_path))
        except ValueError:
            raise Unusable(cert_path, "", "is not a PEM certificate") from None
        try:
            key = serialization.load_pem_private_key(_read(key_path), None)
        except (ValueError, TypeError):
            raise Unusable(key_path, "", "is not an unencrypted PEM private key") from None
        if os.stat(key_path).st_mode & stat.S_IROTH:
            raise ConfigError(key_path, "", "is readable by every user: chmod 0600 (or 0640 "
                              "with the filter's group)")
        if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
            raise ConfigError(key_path, "", "must be an ECDSA (python -m appliance.pki "
                              "intercept-ca) or RSA key: not every client accepts others")
        if key.public_key().public_numbers() != cert.public_key().public_numbers():
            raise Unusable(key_path, "", f"is not the key of {cert_path}")
        try:
            basic = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        except x509.ExtensionNotFound:
            basic = None
        if basic is None or not basic.ca:
            raise Unusable(cert_path, "", "is not a CA certificate (basicConstraints "
                              "CA:TRUE): clients would refuse the leaves it signs")
        start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
        if not start <= now < end:
            error = Unusable if now >= end else ConfigError  # not yet: a clock behind
            raise error(cert_path, "", f"is valid from {start:%Y-%m-%d %H:%M} to "
                        f"{end:%Y-%m-%d %H:%M} UTC, not now: make a new one (python -m "
                        "appliance.pki intercept-ca, or corral certs rotate --interception)")
        try:
            constraints = cert.extensions.get_extension_for_class(x509.NameConstraints).value
            permitted = None if constraints.permitted_subtrees is None else tuple(
                n.value.lower() for n in constraints.permitted_subtrees
                if isinstance(n, x509.DNSName))  # only excluded subtrees: no positive list
        except x509.ExtensionNotFound:
            permitted = None
        try:
            ski = cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
            key_id = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)
        except x509.ExtensionNotFound:
            key_id = x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key())
        return cls(cert, key, permitted, key_id)

    def covers(self, host: Host) -> bool:
        """May this CA sign for `host` (its name constraints, if any)?"""
        if self.permitted is None:
            return True
        name = host.name
        return name is not None and any(name == p or name.endswith("." + p)
                                        for p in self.permitted)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(path, "", f"cannot read: {exc.strerror}") from None


# -- minting (pure but for the clock and the randomness) ----------------------------------------


def mint(authority: Authority, host: Host, now: datetime.datetime) -> tuple[bytes, bytes]:
    """A leaf certificate for `host` with a key of its own: (certificate PEM, key PEM).
    ECDSA P-256, SAN = the host (a DNS name, or an IP address for an IP literal), server
    authentication only, valid a few days and never past the CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    if host.name is not None:
        san: x509.GeneralName = x509.DNSName(host.name)
    else:
        san = x509.IPAddress(host.address)
    subject = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "corral inspection")]
    if len(host.key) <= 64:  # the longest common name X.509 allows; the SAN is what counts
        subject.append(x509.NameAttribute(NameOID.COMMON_NAME, host.key))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(subject)).issuer_name(authority.cert.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(max(now - LEAF_BACKDATE, authority.cert.not_valid_before_utc))
        .not_valid_after(min(now + LEAF_LIFETIME, authority.cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName([san]), critical=False)
        .add_extension(authority.key_id, critical=False)
        .sign(authority.key, hashes.SHA256())
    )
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def server_context(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    """The TLS context a client of an inspected host is answered with: TLS 1.2 or later,
    HTTP/1.1 by ALPN, no renegotiation, P-256 key exchange only."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_RENEGOTIATION
    context.set_alpn_protocols(ALPN)
    # One key exchange group, the one every TLS client must implement (RFC 8446 §9.1): by
    # default OpenSSL 3 also accepts ffdhe2048..ffdhe8192, and a ClientHello offering only
    # ffdhe8192 costs the event loop (the handshake runs on it) over 50 ms, before the
    # client has proved anything. A client whose first key share is another group gets a
    # HelloRetryRequest for P-256. (Python's ssl sets no group list but this one.)
    context.set_ecdh_curve("prime256v1")
    with _memfile(cert_pem) as cert_path, _memfile(key_pem) as key_path:
        context.load_cert_chain(cert_path, key_path)
    return context


@contextlib.contextmanager
def _memfile(data: bytes):
    """A path that reads `data`: load_cert_chain takes files only, and a leaf's key has no
    business on a disk. A memfd on Linux; elsewhere a private temporary file."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("corral-leaf", os.MFD_CLOEXEC)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    with tempfile.NamedTemporaryFile() as f:  # mode 0600
        f.write(data)
        f.flush()
        yield f.name
