"""TLS inspection without sockets: the interception CA and its checks, leaf certificates
(checked by cryptography and by real OpenSSL handshakes between memory BIOs), the leaf
cache and its mint budget, TLS driven by hand over streams, the [inspect] config table."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import ssl
import threading
import warnings
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from appliance import pki
from appliance.filter.denied import Denied
from appliance.filter.proxy.inspect import Inspector, Leaves
from appliance.filter.proxy.pipeline import (
    DISCARD_MAX,
    deny_response,
    keeps_after_refusal,
)
from appliance.filter.proxy.tlsstream import TlsServer
from appliance.filter.redact import NONE
from appliance.filter.relay import Counters
from appliance.pki.intercept import LEAF_LIFETIME, Authority, mint, server_context
from appliance.policy import ConfigError, Decision, Host, parse_host
from appliance.sessionconfig import InspectConfig, parse_config

NOW = datetime.datetime.now(datetime.UTC)


def write_ca(directory: Path, **kwargs) -> tuple[str, str]:
    pki.write_intercept_ca(*pki.intercept_ca(**kwargs), directory)
    return str(directory / "intercept-ca.crt"), str(directory / "intercept-ca.key")


@pytest.fixture(scope="module")
def ca_files(tmp_path_factory) -> tuple[str, str]:
    return write_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def authority(ca_files) -> Authority:
    return Authority.load(*ca_files)


def client_for(ca_cert: str | None, name: str, alpn=("h2", "http/1.1")):
    """(client SSLObject, its incoming BIO, its outgoing BIO), trusting `ca_cert` (None: the
    system store)."""
    context = ssl.create_default_context(cafile=ca_cert)
    context.set_alpn_protocols(list(alpn))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    return context.wrap_bio(incoming, outgoing, server_hostname=name), incoming, outgoing


def handshake(server_ctx: ssl.SSLContext, client) -> ssl.SSLObject:
    """A full handshake between memory BIOs; raises what either side raises."""
    tls, c_in, c_out = client
    s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(10):
        for side, obj, source, sink in (("client", tls, s_out, c_in),
                                        ("server", server, c_out, s_in)):
            if source.pending:
                sink.write(source.read())
            if not done[side]:
                try:
                    obj.do_handshake()
                    done[side] = True
                except ssl.SSLWantReadError:
                    pass
        if s_out.pending:
            c_in.write(s_out.read())
        if all(done.values()) and not s_out.pending and not c_out.pending:
            return server
    raise AssertionError("handshake did not finish")


# -- the CA ------------------------------------------------------------------------------------


def test_the_interception_ca_is_p256_may_sign_leaves_only_and_lives_half_a_year(ca_files):
    cert = x509.load_pem_x509_certificate(Path(ca_files[0]).read_bytes())
    assert isinstance(cert.public_key().curve, ec.SECP256R1)
    basic = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical and basic.value.ca and basic.value.path_length == 0
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and not usage.digital_signature
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert datetime.timedelta(days=179) < lifetime < datetime.timedelta(days=181)
    assert os.stat(ca_files[1]).st_mode & 0o777 == 0o600
    assert os.stat(Path(ca_files[1]).parent).st_mode & 0o777 == 0o700


def test_the_command_writes_the_ca_and_refuses_a_bad_name(tmp_path, capsys):
    assert pki.main(["intercept-ca", "--out", str(tmp_path / "ca"), "--days", "30"]) == 0
    assert {p.name for p in (tmp_path / "ca").iterdir()} == set(pki.INTERCEPT_FILES)
    with pytest.raises(SystemExit):
        pki.main(["intercept-ca", "--out", str(tmp_path / "bad"), "--permit", "a b"])
    assert "a b" in capsys.readouterr().err


def test_a_name_constrained_ca_is_refused_by_clients_outside_its_names(tmp_path):
    cert_path, key_path = write_ca(tmp_path, permit=["example.com"])
    authority = Authority.load(cert_path, key_path)
    assert authority.permitted == ("example.com",)
    assert authority.covers(Host(name="api.example.com"))
    assert not authority.covers(Host(name="example.org"))
    assert not authority.covers(parse_host("10.0.0.1"))
    inside = server_context(*mint(authority, Host(name="api.example.com"), NOW))
    handshake(inside, client_for(cert_path, "api.example.com"))
    outside = server_context(*mint(authority, Host(name="example.org"), NOW))
    with pytest.raises(ssl.SSLCertVerificationError, match="permitted subtree violation"):
        handshake(outside, client_for(cert_path, "example.org"))


def other_key_pem() -> bytes:
    return ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption())


def self_signed(key, ca: bool, days: int = 1, start_days: int = -1) -> bytes:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")])
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
               .public_key(key.public_key()).serial_number(1)
               .not_valid_before(NOW + datetime.timedelta(days=start_days))
               .not_valid_after(NOW + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    algorithm = None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    return builder.sign(key, algorithm).public_bytes(serialization.Encoding.PEM)


def pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def broken_ca(case: str, tmp_path: Path, ca_files) -> tuple[str, str, str]:
    """(cert path, key path, the path the error must name) for one way a CA is unusable."""
    cert, key = tmp_path / "ca.crt", tmp_path / "ca.key"
    cert.write_bytes(Path(ca_files[0]).read_bytes())
    key.write_bytes(Path(ca_files[1]).read_bytes())
    key.chmod(0o600)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    if case == "not pem":
        cert.write_text("hello")
        return str(cert), str(key), str(cert)
    if case == "encrypted key":
        key.write_bytes(ec_key.private_bytes(serialization.Encoding.PEM,
                                             serialization.PrivateFormat.PKCS8,
                                             serialization.BestAvailableEncryption(b"pw")))
    elif case == "other key":
        key.write_bytes(other_key_pem())
    elif case == "world readable":
        key.chmod(0o644)
    elif case in ("not a ca", "expired", "not yet valid", "ed25519"):
        signer = ed25519.Ed25519PrivateKey.generate() if case == "ed25519" else ec_key
        days, start = {"expired": (-1, -2), "not yet valid": (3, 1)}.get(case, (1, -1))
        cert.write_bytes(self_signed(signer, case != "not a ca", days, start))
        key.write_bytes(pem_key(signer))
        return str(cert), str(key), str(key if case == "ed25519" else cert)
    return str(cert), str(key), str(key)


@pytest.mark.parametrize(("case", "message"), [
    ("not pem", "is not a PEM certificate"),
    ("encrypted key", "is not an unencrypted PEM private key"),
    ("other key", "is not the key of"),
    ("world readable", "readable by every user"),
    ("not a ca", "is not a CA certificate"),
    ("expired", "not now"),
    ("not yet valid", "not now"),
    ("ed25519", "must be an ECDSA"),
])
def test_an_unusable_ca_is_a_config_error_naming_the_file(tmp_path, ca_files, case, message):
    cert, key, named = broken_ca(case, tmp_path, ca_files)
    with pytest.raises(ConfigError, match=message) as caught:
        Authority.load(cert, key)
    assert caught.value.path == named


# -- leaves ------------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["api.example.com", "x" * 60 + ".example.com", "192.0.2.7"])
def test_a_leaf_is_signed_by_the_ca_for_exactly_its_host(authority, host):
    cert_pem, key_pem = mint(authority, parse_host(host), NOW)
    leaf = x509.load_pem_x509_certificate(cert_pem)
    leaf.verify_directly_issued_by(authority.cert)
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    expected = (x509.IPAddress(ipaddress.ip_address(host)) if host[0].isdigit()
                else x509.DNSName(host))
    assert list(sans) == [expected]
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == \
        x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH])
    assert isinstance(leaf.public_key().curve, ec.SECP256R1)
    assert leaf.not_valid_after_utc - leaf.not_valid_before_utc <= LEAF_LIFETIME + \
        datetime.timedelta(hours=1)
    key = serialization.load_pem_private_key(key_pem, None)
    assert key.public_key() == leaf.public_key()


def test_a_leaf_never_outlives_its_ca(tmp_path):
    authority = Authority.load(*write_ca(tmp_path, days=1))
    leaf = x509.load_pem_x509_certificate(mint(authority, Host(name="a.test"), NOW)[0])
    assert leaf.not_valid_after_utc == authority.cert.not_valid_after_utc
    assert leaf.not_valid_before_utc >= authority.cert.not_valid_before_utc


def test_a_client_trusting_the_ca_completes_a_handshake_with_http_1_1(authority, ca_files):
    context = server_context(*mint(authority, Host(name="a.test"), NOW))
    server = handshake(context, client_for(ca_files[0], "a.test"))
    assert server.selected_alpn_protocol() == "http/1.1"
    assert server.version() in ("TLSv1.2", "TLSv1.3")


@pytest.mark.parametrize(("trust", "name", "error"), [
    ("system", "a.test", "unable to get local issuer certificate"),
    ("corral", "b.test", "Hostname mismatch"),
])
def test_a_client_that_does_not_accept_the_leaf_fails_the_handshake(
        authority, ca_files, trust, name, error):
    context = server_context(*mint(authority, Host(name="a.test"), NOW))
    client = client_for(None if trust == "system" else ca_files[0], name)
    with pytest.raises(ssl.SSLCertVerificationError, match=error):
        handshake(context, client)


def test_old_tls_is_refused(authority, ca_files):
    context = server_context(*mint(authority, Host(name="a.test"), NOW))
    old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    old.load_verify_locations(ca_files[0])
    with warnings.catch_warnings():  # asking for TLS 1.1 is deprecated: that is the point
        warnings.simplefilter("ignore", DeprecationWarning)
        old.minimum_version = ssl.TLSVersion.TLSv1
        old.maximum_version = ssl.TLSVersion.TLSv1_1
    old.set_ciphers("DEFAULT:@SECLEVEL=0")
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    with pytest.raises(ssl.SSLError, match="unsupported protocol"):
        handshake(context, (old.wrap_bio(incoming, outgoing, server_hostname="a.test"),
                            incoming, outgoing))


# -- the cache and the mint budget -------------------------------------------------------------


class CountingLeaves(Leaves):
    """Leaves that note the thread each mint ran on."""

    threads: list[str]

    def _mint(self, host):
        self.threads.append(threading.current_thread().name)
        return super()._mint(host)


def leaves(authority, size=4, rate=0.001, burst=100) -> CountingLeaves:
    found = CountingLeaves(authority, size, rate, burst)
    found.threads = []
    return found


def run(coro, timeout: float = 60):
    """`coro` to its end, or an AssertionError after `timeout`: a scenario awaits what the
    code under test should deliver (a mint, a handshake, decrypted bytes), never for ever."""
    try:
        return asyncio.run(asyncio.wait_for(coro, timeout))
    except TimeoutError as exc:  # the traceback above it shows the await that was waiting
        raise AssertionError(f"the scenario still waiting after {timeout}s") from exc


def test_leaves_are_minted_off_the_loop_and_kept_least_recently_used_first(authority):
    cache = leaves(authority, size=2)

    async def scenario():
        a = await cache.get(Host(name="a.test"), "s1")
        await cache.get(Host(name="b.test"), "s1")
        assert await cache.get(Host(name="a.test"), "s1") is a  # a hit, and now the newest
        await cache.get(Host(name="c.test"), "s1")  # b goes
        return a

    a = run(scenario())
    assert list(cache.cache) == ["a.test", "c.test"] and cache.cache["a.test"].context is a
    assert cache.stats == {"minted": 3, "hits": 1, "refused": 0, "evicted": 1, "failed": 0}
    assert cache.threads and all(t.startswith("corral-mint") for t in cache.threads)
    cache.close()


def test_first_connections_to_one_host_share_one_mint(authority):
    cache = leaves(authority)

    async def scenario():
        return await asyncio.gather(*(cache.get(Host(name="a.test"), "s1") for _ in range(5)))

    contexts = run(scenario())
    assert all(c is contexts[0] for c in contexts) and cache.stats["minted"] == 1
    assert len(cache.threads) == 1
    cache.close()


def test_a_session_over_its_mint_budget_is_refused_and_the_others_are_not(authority):
    cache = leaves(authority, size=100, burst=3)

    async def scenario():
        for i in range(3):
            await cache.get(Host(name=f"n{i}.flood.test"), "s1")
        with pytest.raises(Denied, match=r"\[inspect\] mint_rate") as refused:
            await cache.get(Host(name="n3.flood.test"), "s1")
        assert refused.value.status == 403 and refused.value.target == "n3.flood.test"
        await cache.get(Host(name="n0.flood.test"), "s1")  # cached: no budget needed
        await cache.get(Host(name="mine.test"), "s2")  # another session's own budget

    run(scenario())
    assert cache.stats["refused"] == 1 and cache.stats["minted"] == 4
    cache.close()


class OrderedLeaves(Leaves):
    """Leaves that note the order hosts are minted in."""

    order: list[str]

    def _mint(self, host):
        self.order.append(host.key)
        return super()._mint(host)


def test_one_sessions_burst_delays_anothers_first_mint_by_one_mint_at_most(authority):
    cache = OrderedLeaves(authority, 100, 0.001, 100)
    cache.order = []

    async def scenario():
        burst = [asyncio.ensure_future(cache.get(Host(name=f"n{i}.burst.test"), "s1"))
                 for i in range(8)]
        await asyncio.sleep(0)  # the burst is asked for first
        mine = asyncio.ensure_future(cache.get(Host(name="mine.test"), "s2"))
        theirs = asyncio.ensure_future(cache.get(Host(name="theirs.test"), "s3"))
        await asyncio.gather(*burst, mine, theirs)

    run(scenario())
    # the burst's first mint was under way; then each session's first, before the burst's next
    assert cache.order[:4] == ["n0.burst.test", "mine.test", "theirs.test", "n1.burst.test"]
    assert sorted(cache.order) == sorted([f"n{i}.burst.test" for i in range(8)]
                                         + ["mine.test", "theirs.test"])
    assert cache.stats["minted"] == 10 and cache.pending == {}
    cache.close()


def test_a_session_that_joins_anothers_queued_mint_waits_its_own_turn_not_theirs(authority):
    cache = OrderedLeaves(authority, 100, 0.001, 100)
    cache.order = []

    async def scenario():
        burst = [asyncio.ensure_future(cache.get(Host(name=f"n{i}.burst.test"), "s1"))
                 for i in range(6)]
        popular = asyncio.ensure_future(cache.get(Host(name="popular.test"), "s1"))
        await asyncio.sleep(0)  # s1's burst, then a host everyone uses, all queued
        mine = asyncio.ensure_future(cache.get(Host(name="popular.test"), "s2"))
        await asyncio.gather(*burst, popular, mine)
        return mine.result() is popular.result()

    assert run(scenario())  # one mint for both
    assert cache.order[:2] == ["n0.burst.test", "popular.test"], cache.order
    assert cache.stats["minted"] == 7 and cache.pending == {} and cache.queued == {}
    cache.close()


def test_a_new_ca_denies_the_mints_waiting_their_turn_and_none_waits_forever(authority,
                                                                            tmp_path):
    """Rotating the CA retires the old leaves: the mint under way finishes, the ones queued
    behind it are denied (their clients connect again), nothing is left waiting."""
    cache = leaves(authority, size=100, burst=100)

    async def scenario():
        waiting = [asyncio.ensure_future(cache.get(Host(name=f"n{i}.test"), f"s{i % 3}"))
                   for i in range(10)]
        await asyncio.sleep(0)
        cache.retire("the interception CA changed")
        done, still = await asyncio.wait(waiting, timeout=10)
        assert not still  # none hangs
        denied = [t.exception() for t in done if t.exception() is not None]
        assert denied and all(isinstance(e, Denied) and "the interception CA changed" in
                              str(e.decision.reason) for e in denied)
        assert 1 <= 10 - len(denied) <= 2  # what was under way finished
        with pytest.raises(Denied, match="the interception CA changed"):
            await cache.get(Host(name="later.test"), "s1")  # nothing more is minted

    run(scenario())
    assert cache.pending == {} and cache.queued == {}


def test_the_fair_queue_takes_sessions_in_turn_and_each_in_order():
    from appliance.filter.proxy.inspect import FairQueue
    queue = FairQueue()
    for item in ("a1", "a2", "a3"):
        queue.push("a", item)
    queue.push("b", "b1")
    assert queue.pop() == "a1"
    queue.push("c", "c1")
    queue.push("b", "b2")
    assert [queue.pop() for _ in range(len(queue))] == ["b1", "c1", "a2", "b2", "a3"]
    assert queue.pop() is None and len(queue) == 0
    queue.push(None, "outside")  # a client outside every session is one more turn
    assert queue.pop() == "outside"


def test_a_mint_that_fails_is_a_denial_and_is_not_kept(authority):
    class Failing(Leaves):
        def _mint(self, host):
            raise ValueError("no good")

    cache = Failing(authority, 4, 1, 10)

    async def scenario():
        with pytest.raises(Denied, match=r"cannot make a certificate for a\.test: no good"):
            await cache.get(Host(name="a.test"), "s1")

    run(scenario())
    assert cache.cache == {} and cache.pending == {} and cache.stats["failed"] == 1
    cache.close()


def test_the_inspector_refuses_hosts_outside_the_cas_name_constraints(tmp_path):
    cert, key = write_ca(tmp_path, permit=["example.com"])
    config = parse_config(f'[inspect]\nca_cert = "{cert}"\nca_key = "{key}"\n',
                          str(tmp_path / "f.toml"))
    inspector = Inspector.from_config(config.inspect)

    async def scenario():
        with pytest.raises(Denied, match="outside the interception CA's name constraints"):
            await inspector.leaf(Host(name="example.org"), None)
        return await inspector.leaf(Host(name="www.example.com"), None)

    assert isinstance(run(scenario()), ssl.SSLContext)
    assert inspector.status()["leaves"] == 1
    inspector.close()


# -- TLS driven by hand over streams -----------------------------------------------------------


class Collect:
    """The raw writer: what the server sends the client."""

    def __init__(self):
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    def is_closing(self) -> bool:
        return False

    async def drain(self) -> None:
        pass


def test_tls_by_hand_replays_the_hello_and_decrypts_what_rides_behind_it(authority, ca_files):
    """The ClientHello was read before the server existed (to see its SNI): it is fed in
    first; the request the client sends right behind its Finished comes out in plaintext,
    and the client's close_notify ends the reader."""
    client, c_in, c_out = client_for(ca_files[0], "a.test")

    async def scenario():
        raw = asyncio.StreamReader()
        sent = Collect()
        server = TlsServer(server_context(*mint(authority, Host(name="a.test"), NOW)), raw,
                           sent, Counters(), 65536)
        with pytest.raises(ssl.SSLWantReadError):
            client.do_handshake()
        hello = c_out.read()

        async def client_side():
            while True:
                await asyncio.sleep(0)
                if sent.data:
                    c_in.write(bytes(sent.data))
                    sent.data.clear()
                try:
                    client.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    if c_out.pending:
                        raw.feed_data(c_out.read())
            client.write(b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n")
            raw.feed_data(c_out.read())

        task = asyncio.ensure_future(client_side())
        await server.handshake(hello, 5)
        await task
        assert await server.reader.readuntil(b"\r\n\r\n") == (
            b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n")
        server.writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        c_in.write(bytes(sent.data))
        assert client.read(1024) == b"HTTP/1.1 204 No Content\r\n\r\n"
        with pytest.raises(ssl.SSLWantReadError):
            client.unwrap()
        raw.feed_data(c_out.read())
        assert await server.reader.read() == b""
        server.close()

    run(scenario())


# -- refusals by request rules ------------------------------------------------------------------


def request(text: str):
    from appliance.filter.http import parse_request
    return parse_request(text.replace("\n", "\r\n").encode() + b"\r\n")


@pytest.mark.parametrize(("text", "keeps"), [
    ("DELETE /x HTTP/1.1\nHost: a\n", True),
    (f"POST /x HTTP/1.1\nHost: a\nContent-Length: {DISCARD_MAX}\n", True),
    (f"POST /x HTTP/1.1\nHost: a\nContent-Length: {DISCARD_MAX + 1}\n", False),
    ("POST /x HTTP/1.1\nHost: a\nTransfer-Encoding: chunked\n", False),
    ("POST /x HTTP/1.1\nHost: a\nContent-Length: 3\nExpect: 100-continue\n", False),
    ("GET /x HTTP/1.1\nHost: a\nConnection: close\n", False),
    ("GET /x HTTP/1.0\n", False),
    ("GET /x HTTP/1.0\nConnection: keep-alive\n", True),
])
def test_a_refused_request_keeps_its_connection_only_where_http_allows(text, keeps):
    assert keeps_after_refusal(request(text)) is keeps


def test_a_refusal_that_keeps_the_connection_says_so():
    denied = Denied(Decision(False, "POST /gists denied"), "POST /gists on a.test:443")
    kept = deny_response(denied, keep=True, redactor=NONE)
    assert b"Connection: keep-alive\r\n" in kept and b"X-Corral-Deny: POST /gists denied" in kept
    assert b"Connection: close\r\n" in deny_response(denied, redactor=NONE)


# -- the [inspect] table -------------------------------------------------------------------------


def test_inspection_is_off_without_a_ca_and_on_with_both_files(tmp_path, ca_files):
    off = parse_config("", str(tmp_path / "f.toml")).inspect
    assert not off.enabled and Inspector.from_config(off) is None
    on = parse_config(f'[inspect]\nca_cert = "{ca_files[0]}"\nca_key = "{ca_files[1]}"\n'
                      "leaf_cache = 16\n", str(tmp_path / "f.toml")).inspect
    assert on.enabled and on.leaf_cache == 16 and on.upstream_ca is None


@pytest.mark.parametrize(("body", "message"), [
    ('ca_cert = "{cert}"', r"\[inspect\] ca_key: ca_cert and ca_key go together"),
    ('ca_cert = "{cert}"\nca_key = "/nonexistent/ca.key"',
     r"\[inspect\] ca_key: cannot read /nonexistent/ca.key: No such file"),
    ('ca_cert = "{cert}"\nca_key = "{key}"\nupstream_ca = "/nonexistent/b.pem"',
     r"\[inspect\] upstream_ca: cannot read /nonexistent/b.pem"),
    ("ca = 1", r"\[inspect\] ca: unknown key"),
    ("mint_rate = 0", r"\[inspect\] mint_rate: must be greater than 0"),
])
def test_a_bad_inspect_table_is_a_config_error_naming_key_and_file(tmp_path, ca_files, body,
                                                                   message):
    text = "[inspect]\n" + body.format(cert=ca_files[0], key=ca_files[1]) + "\n"
    with pytest.raises(ConfigError, match=message):
        parse_config(text, str(tmp_path / "f.toml"))


def test_an_upstream_bundle_without_certificates_is_a_config_error(tmp_path, ca_files):
    bundle = tmp_path / "bundle.pem"
    bundle.write_text("not a certificate\n")
    config = parse_config(f'[inspect]\nca_cert = "{ca_files[0]}"\nca_key = "{ca_files[1]}"\n'
                          f'upstream_ca = "{bundle}"\n', str(tmp_path / "f.toml"))
    with pytest.raises(ConfigError, match="holds no usable CA certificate") as caught:
        Inspector.from_config(config.inspect)
    assert caught.value.path == str(bundle)


def test_the_filters_ca_directory_swaps_whole_pairs(tmp_path):
    directory = pki.CaDirectory(tmp_path / "ca")
    assert directory.ensure() and not directory.ensure()  # made once, then kept
    first = directory.cert.read_bytes()
    Authority.load(str(directory.cert), str(directory.key))
    # a rotation cut short before `current` moved: a generation nobody points at
    (tmp_path / "ca" / "ca-interrupted").mkdir()
    (tmp_path / "ca" / "ca-interrupted" / pki.INTERCEPT_FILES[1]).write_bytes(b"partial")
    assert not directory.ensure() and directory.cert.read_bytes() == first
    directory.rotate()
    assert directory.cert.read_bytes() != first
    Authority.load(str(directory.cert), str(directory.key))  # a matching pair
    left = sorted(p.name for p in (tmp_path / "ca").iterdir())
    assert len(left) == 2 and pki.CURRENT in left  # the generation in use, and its link
    assert (tmp_path / "ca").stat().st_mode & 0o777 == 0o700
    assert directory.key.stat().st_mode & 0o777 == 0o600


def test_ca_dir_and_ca_files_are_one_or_the_other(tmp_path):
    cert, key = write_ca(tmp_path)
    base = '[dns]\nlisten = []\n[proxy]\nlisten = []\n'
    with pytest.raises(ConfigError, match=r"ca_dir.*not both"):
        parse_config(base + f'[inspect]\nca_dir = "{tmp_path}/d"\nca_cert = "{cert}"\n'
                     f'ca_key = "{key}"\n', "filter.toml")
    config = parse_config(base + f'[inspect]\nca_dir = "{tmp_path}/d"\n', "filter.toml")
    assert config.inspect.enabled and not (tmp_path / "d").exists()  # made at start only


def test_a_rotation_clears_only_what_rotations_make(tmp_path):
    directory = pki.CaDirectory(tmp_path / "ca")
    directory.ensure()
    (tmp_path / "ca" / "lost+found" / "x").mkdir(parents=True)  # not ours: left alone
    (tmp_path / "ca" / "notes").mkdir()
    os.symlink("ca-gone", tmp_path / "ca" / f".{pki.CURRENT}.ca-gone")  # a crash's leftover
    directory.rotate()
    left = {p.name for p in (tmp_path / "ca").iterdir()}
    assert {"lost+found", "notes", pki.CURRENT} <= left
    assert not any(name.startswith(".current.") for name in left)
    assert len([n for n in left if n.startswith("ca-")]) == 1


def test_a_ca_not_valid_yet_is_kept_not_replaced(tmp_path):
    """A clock behind (a VM restored from a snapshot) must not cost the CA its key."""
    directory = pki.CaDirectory(tmp_path / "ca")
    directory.ensure()
    key = serialization.load_pem_private_key(directory.key.read_bytes(), None)
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tomorrow")])
    future = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
              .public_key(key.public_key()).serial_number(1)
              .not_valid_before(now + datetime.timedelta(days=1))
              .not_valid_after(now + datetime.timedelta(days=30))
              .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
              .sign(key, hashes.SHA256()))
    directory.cert.write_bytes(future.public_bytes(serialization.Encoding.PEM))
    kept = directory.cert.read_bytes(), directory.key.read_bytes()
    with pytest.raises(ConfigError, match="not now"):
        Inspector.from_config(InspectConfig(ca_dir=str(tmp_path / "ca")))
    assert (directory.cert.read_bytes(), directory.key.read_bytes()) == kept


def test_ca_dir_must_be_a_directory_of_its_own(tmp_path):
    base = f'[dns]\nlisten = []\n[proxy]\nlisten = []\n[state]\ndir = "{tmp_path}/state"\n'
    for bad in (f"{tmp_path}/state", str(tmp_path), "relative/ca"):
        with pytest.raises(ConfigError, match="directory of its own"):
            parse_config(base + f'[inspect]\nca_dir = "{bad}"\n', "filter.toml")
    assert parse_config(base + f'[inspect]\nca_dir = "{tmp_path}/state/ca"\n', "f.toml")


def test_upstream_tls_sessions_are_kept_per_corral_session_and_go_with_it():
    """What ResumingContext keeps: a session's TLS session per (host, port); none for a
    client outside every session; those of a corral session that is gone are dropped."""
    from types import SimpleNamespace

    from appliance.filter.proxy.inspect import upstream_context
    context = upstream_context(None)
    ticket = SimpleNamespace(session=SimpleNamespace(has_ticket=True))
    context.keep(("s1", "a.test", 443), ticket)
    context.keep(("s2", "a.test", 443), ticket)
    context.keep((None, "a.test", 443), ticket)
    context.keep(("s1", "b.test", 443), SimpleNamespace(session=None))  # no ticket: nothing
    assert set(context.tickets) == {("s1", "a.test", 443), ("s2", "a.test", 443)}
    context.forget({"s2"})
    assert set(context.tickets) == {("s2", "a.test", 443)}
