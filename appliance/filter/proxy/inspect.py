"""Opt-in TLS inspection: the interception CA, leaf certificates, the upstream's TLS context.

A host the policy marks inspected (`Policy.inspection(host)`) is not spliced: the filter ends
the client's TLS with a leaf certificate for the name the client asked for, signed by the
appliance's interception CA, opens TLS of its own to the upstream (verified against the
system trust store or `[inspect] upstream_ca`), and runs every request in between through
the same pipeline as plain HTTP. tunnel.py moves those bytes; this module holds no socket.

Leaves are minted on first use and kept in an LRU (`[inspect] leaf_cache`), one per host.
A mint costs about a millisecond, nearly all of it OpenSSL loading the new certificate and
key into a TLS context, which it does with the GIL released: so mints run on one worker
thread and the event loop never pays for them (invariant 10). The worker is shared, so a
session may have only `mint_rate` minted a second (`mint_burst` at once): a flood of new
names under an inspected wildcard is refused with a reason, not queued ahead of the other
sessions' hosts. Concurrent first connections to one host share one mint.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import ssl
import stat
import tempfile
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from appliance.pki import CaDirectory
from appliance.policy import ConfigError, Decision, Host
from appliance.sessionconfig import InspectConfig

from ..ratelimit import TokenBucket
from .pipeline import Denied

log = logging.getLogger(__name__)

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


def upstream_context(cafile: str | None) -> ssl.SSLContext:
    """The filter's TLS towards inspected upstreams: verified (chain and name) against
    `cafile`, or the system trust store; TLS 1.2 or later; HTTP/1.1 by ALPN."""
    try:
        context = ssl.create_default_context(cafile=cafile)
    except ssl.SSLError as exc:
        raise ConfigError(cafile or "the system trust store", "",
                          f"holds no usable CA certificate: {exc.reason}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(ALPN)
    return context


# -- the cache ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Leaf:
    context: ssl.SSLContext
    until: float
    """Monotonic time after which it is minted again."""


class Leaves:
    """Leaf TLS contexts by host: an LRU of `size`, minted off the loop on first use, within
    each session's mint budget."""

    def __init__(self, authority: Authority, size: int, rate: float, burst: int):
        self.authority = authority
        self.size, self.rate, self.burst = size, rate, burst
        self.cache: OrderedDict[str, Leaf] = OrderedDict()
        self.pending: dict[str, asyncio.Future] = {}
        """Mints under way, by host: later askers wait for the same one."""
        self.buckets: dict[str | None, TokenBucket] = {}
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="corral-mint")
        self.stats = {"minted": 0, "hits": 0, "refused": 0, "evicted": 0, "failed": 0}

    async def get(self, host: Host, session: str | None) -> ssl.SSLContext:
        """The server context for `host`. Raises Denied when the session is over its mint
        budget or the mint fails."""
        now = time.monotonic()
        leaf = self.cache.get(host.key)
        if leaf is not None and now < leaf.until:
            self.cache.move_to_end(host.key)
            self.stats["hits"] += 1
            return leaf.context
        pending = self.pending.get(host.key)
        if pending is None:
            bucket = self.buckets.get(session)
            if bucket is None:
                bucket = self.buckets[session] = TokenBucket(self.rate, self.burst, now)
            if not bucket.take(now):
                self.stats["refused"] += 1
                raise Denied(Decision(False, f"session {session or '(outside every session)'}"
                                      f" asked for more new inspected hosts than {self.rate:g}"
                                      f" a second ({self.burst} at once): [inspect] mint_rate"),
                             str(host))
            pending = asyncio.get_running_loop().run_in_executor(self.worker, self._mint, host)
            self.pending[host.key] = pending
            pending.add_done_callback(lambda done, key=host.key: self._minted(key, done))
        try:  # shielded: one client that gives up does not cancel the others' mint
            return await asyncio.shield(pending)
        except Exception as exc:  # a mint that fails is a denial, like any other error
            raise Denied(Decision(False, f"cannot make a certificate for {host}: {exc}"),
                         str(host)) from None

    def _mint(self, host: Host) -> ssl.SSLContext:
        """On the worker thread."""
        return server_context(*mint(self.authority, host, datetime.datetime.now(datetime.UTC)))

    def _minted(self, key: str, done: asyncio.Future) -> None:
        """On the loop: keep what was minted, drop the least recently used beyond `size`."""
        self.pending.pop(key, None)
        if done.cancelled() or done.exception() is not None:
            self.stats["failed"] += 1
            return
        self.stats["minted"] += 1
        self.cache[key] = Leaf(done.result(), time.monotonic() + LEAF_REUSE)
        self.cache.move_to_end(key)
        while len(self.cache) > self.size:
            self.cache.popitem(last=False)
            self.stats["evicted"] += 1

    def forget(self, alive: set) -> None:
        """Drop the budgets of sessions that are gone."""
        for session in [s for s in self.buckets if s is not None and s not in alive]:
            del self.buckets[session]

    def close(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)


class Inspector:
    """What the proxy needs to inspect: leaves for clients, a context for upstreams."""

    def __init__(self, authority: Authority, upstream: ssl.SSLContext, config: InspectConfig,
                 directory: CaDirectory | None = None):
        self.authority = authority
        self.upstream = upstream
        self.config = config
        self.directory = directory
        """The filter's own CA (`[inspect] ca_dir`), which `renewed` replaces; None for a
        CA given as files, which only its maker replaces."""
        self.leaves = self._leaves()

    def _leaves(self) -> Leaves:
        config = self.config
        return Leaves(self.authority, config.leaf_cache, config.mint_rate, config.mint_burst)

    @classmethod
    def from_config(cls, config: InspectConfig) -> Inspector | None:
        """None when no CA is configured (inspection off). With `ca_dir`, the filter's own CA
        is made there when there is none, or none usable (expired, damaged: it could sign
        nothing a client accepts). Raises ConfigError."""
        if not config.enabled:
            return None
        upstream = upstream_context(config.upstream_ca)
        if config.ca_dir is not None:
            directory = CaDirectory(config.ca_dir)
            try:
                if directory.ensure():
                    log.info("inspect: made an interception CA in %s", directory.path)
                try:
                    authority = Authority.load(str(directory.cert), str(directory.key))
                except Unusable as exc:
                    log.warning("inspect: the CA in %s is not usable (%s): making a new one; "
                                "running sessions trust it after `corral certs rotate "
                                "--interception`", directory.path, exc)
                    directory.rotate()
                    authority = Authority.load(str(directory.cert), str(directory.key))
            except OSError as exc:
                raise ConfigError(config.ca_dir, "[inspect] ca_dir", f"cannot keep the "
                                  f"interception CA there: {exc.strerror or exc}") from None
            return cls(authority, upstream, config, directory)
        return cls(Authority.load(config.ca_cert, config.ca_key), upstream, config)

    def renewed(self) -> Authority:
        """A new CA in the directory, loaded (blocking: run it off the loop). Raises
        ConfigError for a CA given as files."""
        if self.directory is None:
            raise ConfigError(self.config.ca_cert or "", "[inspect]", "the CA is given as "
                              "ca_cert and ca_key: make a new pair with `python -m "
                              "appliance.pki intercept-ca` and restart the filter, or let it "
                              "keep its own with ca_dir")
        self.directory.rotate()
        return Authority.load(str(self.directory.cert), str(self.directory.key))

    def use(self, authority: Authority) -> None:
        """Sign with `authority` from now on: the leaves of the old CA go (mints under way
        finish into the old cache, which nothing reads)."""
        old, self.authority = self.leaves, authority
        self.leaves = self._leaves()
        old.worker.shutdown(wait=False)

    def days_left(self) -> int:
        left = self.authority.cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
        return left.days

    def describe(self) -> dict:
        """The CA as sessions need it (its certificate) and people check it."""
        cert = self.authority.cert
        return {"pem": cert.public_bytes(serialization.Encoding.PEM).decode(),
                "sha256": cert.fingerprint(hashes.SHA256()).hex(":"),
                "subject": cert.subject.rfc4514_string(),
                "not_before": cert.not_valid_before_utc.isoformat(),
                "not_after": cert.not_valid_after_utc.isoformat(),
                "days_left": self.days_left(),
                "permitted": list(self.authority.permitted) if self.authority.permitted
                is not None else None,
                "rotatable": self.directory is not None}

    async def leaf(self, host: Host, session: str | None) -> ssl.SSLContext:
        """The context to answer a client of `host` with. Raises Denied."""
        if not self.authority.covers(host):
            raise Denied(Decision(False, f"{host} is outside the interception CA's name "
                                  f"constraints ({', '.join(self.authority.permitted or ())})"
                                  ": its clients would refuse the certificate"), str(host))
        return await self.leaves.get(host, session)

    def status(self) -> dict:
        cert = self.authority.cert
        return {**self.leaves.stats, "leaves": len(self.leaves.cache),
                "ca_sha256": cert.fingerprint(hashes.SHA256()).hex(":"),
                "ca_not_after": cert.not_valid_after_utc.isoformat(),
                "ca_days_left": self.days_left()}

    def close(self) -> None:
        self.leaves.close()


def no_inspector(host: Host) -> Denied:
    """An inspected host where the filter has no interception CA: denied, never spliced."""
    return Denied(Decision(False, f"{host} is to be inspected, but the filter has no "
                           "interception CA ([inspect] ca_dir)"), str(host))
