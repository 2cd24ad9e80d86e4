"""Placeholders in, secrets out, for the bound hosts only (proxy/credentials.py), and the
store that holds them (secrets.py): no sockets, no filter."""

from __future__ import annotations

import base64
import json

import pytest

from appliance.filter import secrets
from appliance.filter.proxy.credentials import Credentials, Leak
from appliance.policy import ConfigError, Host, Policy, Rule

VALUE = "sk-live-0123456789abcdef"
KEY = b"k" * 32


def secret(**fields) -> secrets.Secret:
    return secrets.parse({"name": "API_TOKEN", "value": VALUE, "hosts": ["api.example.com"],
                          **fields})


def credentials(*items: secrets.Secret) -> Credentials:
    return Credentials(KEY, {s.name: s for s in items})


API = Host(name="api.example.com")
OTHER = Host(name="other.example.org")


def apply(creds, headers, host=API, target="/v1/x", tls=True, session="s1"):
    return creds.apply(session, host, target, tuple(headers), tls)


def basic(text: str) -> str:
    return "Basic " + base64.b64encode(text.encode()).decode()


def test_placeholders_are_per_session_stable_and_shaped_as_announced():
    creds = credentials(secret())
    first = creds.placeholder("s1", "API_TOKEN")
    assert first == creds.placeholder("s1", "API_TOKEN") == creds.environment("s1")["API_TOKEN"]
    assert first != creds.placeholder("s2", "API_TOKEN")
    assert first.startswith("corral-secret-api-token-") and len(first) == len(
        "corral-secret-api-token-") + 32
    assert first != Credentials(b"x" * 32, creds.secrets).placeholder("s1", "API_TOKEN")


@pytest.mark.parametrize("form, sent, expected", [
    ({}, "Bearer {p}", f"Bearer {VALUE}"),
    ({}, "bearer {p}", f"bearer {VALUE}"),
    ({}, "token {p}", f"token {VALUE}"),  # as gh sends it
    ({"scheme": "header", "header": "X-Api-Key"}, "{p}", VALUE),
    ({"scheme": "basic", "user": "x-access-token"}, "basic:git:{p}",
     basic(f"x-access-token:{VALUE}")),
    ({"scheme": "basic", "user": "x-access-token"}, "basic:{p}:",
     basic(f"x-access-token:{VALUE}")),  # the token as user, as in https://TOKEN@host/
])
def test_the_placeholder_becomes_the_value_in_its_form_on_its_host(form, sent, expected):
    creds = credentials(secret(**form))
    placeholder = creds.placeholder("s1", "API_TOKEN")
    field = "X-Api-Key" if form.get("scheme") == "header" else "Authorization"
    value = sent.format(p=placeholder)
    if value.startswith("basic:"):
        value = basic(value.removeprefix("basic:"))
    applied = apply(creds, [("Accept", "*/*"), (field, value)])
    assert applied.headers == (("Accept", "*/*"), (field, expected))
    assert applied.used == ("API_TOKEN",)


def test_a_request_without_placeholders_is_left_as_it_is():
    creds = credentials(secret())
    headers = (("Authorization", "Bearer my-own-token"), ("Accept", "*/*"))
    assert apply(creds, headers).headers == headers and apply(creds, headers).used == ()


@pytest.mark.parametrize("case", ["other host", "plain http", "other session", "other field",
                                  "query", "encoded query", "field name", "basic elsewhere",
                                  "wrong form", "made up", "outside any session"])
def test_a_placeholder_anywhere_else_is_a_leak_naming_where(case):
    creds = credentials(secret(scheme="header", header="x-api-key"))
    mine = creds.placeholder("s1", "API_TOKEN")
    kwargs, headers = {}, [("x-api-key", mine)]
    if case == "other host":
        kwargs["host"] = OTHER
    elif case == "plain http":
        kwargs["tls"] = False
    elif case == "other session":
        headers = [("x-api-key", creds.placeholder("s2", "API_TOKEN"))]
    elif case == "other field":
        headers = [("x-token", mine)]
    elif case == "query":
        headers, kwargs["target"] = [], f"/v1/x?key={mine}"
    elif case == "encoded query":
        headers, kwargs["target"] = [], "/v1/x?key=%63orral%2Dsecret%2Dapi-token-00"
    elif case == "field name":
        headers = [(mine, "1")]
    elif case == "basic elsewhere":
        headers = [("Authorization", basic(f"me:{mine}"))]
    elif case == "wrong form":
        headers = [("x-api-key", f"Bearer {mine}")]
    elif case == "made up":
        headers = [("x-api-key", "CORRAL-SECRET-whatever")]
    elif case == "outside any session":
        kwargs["session"] = None
    with pytest.raises(Leak) as caught:
        apply(creds, headers, **kwargs)
    leak = caught.value
    assert VALUE not in str(leak) and mine not in leak.where
    expected = "API_TOKEN" if case in ("other host", "plain http", "other field", "query",
                                       "field name", "basic elsewhere", "wrong form") else None
    assert leak.secret == expected, (case, leak.secret)


def test_names_carrying_a_placeholder_are_never_resolved_or_reached():
    policy = Policy([Rule.parse("dns", "*.example.com"), Rule.parse("http", "*.example.com"),
                     Rule.parse("tcp", "*.example.com:443")])
    marked = Host(name="corral-secret-api-token-00ff.example.com")
    for decision in (policy.decide_dns(marked), policy.decide_http(marked, 443),
                     policy.decide_tcp(marked, 443)):
        assert not decision.allowed and "placeholder" in decision.reason
        assert not decision.hint  # nothing to allow: no rule opens it
    assert policy.decide_dns(Host(name="www.example.com")).allowed


@pytest.mark.parametrize("fields, complaint", [
    ({"name": "api_token"}, "environment variable"),
    ({"name": "HTTPS_PROXY"}, "session's own"),
    ({"name": "LD_PRELOAD"}, "session's own"),
    ({"value": f"{VALUE}\r\nX-Injected: 1"}, "printable ASCII"),
    ({"value": "has space"}, "printable ASCII"),
    ({"value": "short7c"}, "at least 8, the shortest the leak scanner looks for"),
    ({"hosts": []}, "1-32 host names"),
    ({"hosts": ["not a host"]}, "host 'not a host'"),
    ({"scheme": "header"}, "'header' must name a field"),
    ({"scheme": "header", "header": "Host"}, "'header' must name a field"),
    ({"scheme": "basic"}, "needs a 'user'"),
    ({"scheme": "bearer", "user": "x"}, "'user' goes with scheme 'basic'"),
    ({"scheme": "magic"}, "'scheme' must be one of"),
])
def test_a_secret_that_cannot_be_stored_is_refused_saying_why_never_showing_it(
        fields, complaint):
    with pytest.raises(secrets.SecretError, match=complaint) as caught:
        secret(**fields)
    assert VALUE not in str(caught.value)


def test_the_store_keeps_its_key_and_secrets_privately_across_restarts(tmp_path):
    store = secrets.SecretStore.load(tmp_path)
    path = tmp_path / secrets.FILE
    assert path.stat().st_mode & 0o777 == 0o600
    assert store.set(secret()) is True and store.set(secret()) is False
    again = secrets.SecretStore.load(tmp_path)
    assert again.key == store.key and again.secrets == store.secrets
    assert "value" not in json.dumps(again.secrets["API_TOKEN"].describe())
    assert again.remove("API_TOKEN").name == "API_TOKEN"
    assert secrets.SecretStore.load(tmp_path).secrets == {}
    with pytest.raises(LookupError, match="no secret 'API_TOKEN'; secrets: none"):
        again.remove("API_TOKEN")


def test_a_change_that_cannot_be_written_changes_nothing(tmp_path):
    store = secrets.SecretStore.load(tmp_path)
    store.set(secret())
    (tmp_path / "file").write_text("")
    store.path = tmp_path / "file" / secrets.FILE  # a directory that is a file: even root fails
    with pytest.raises(OSError):
        store.remove("API_TOKEN")
    with pytest.raises(OSError):
        store.set(secret(name="OTHER_TOKEN"))
    assert list(store.secrets) == ["API_TOKEN"]


def test_a_damaged_store_is_named_with_the_way_out(tmp_path):
    (tmp_path / secrets.FILE).write_text("{not json")
    with pytest.raises(ConfigError, match="restore it from a backup, or remove it"):
        secrets.SecretStore.load(tmp_path)
    (tmp_path / secrets.FILE).write_text('{"key": "zz", "secrets": {}}')
    with pytest.raises(ConfigError, match="not a secrets file"):
        secrets.SecretStore.load(tmp_path)


@pytest.mark.parametrize("encode", [
    lambda t: base64.b64encode(t).decode().rstrip("="),         # no padding
    lambda t: base64.urlsafe_b64encode(t).decode(),              # URL-safe letters
    lambda t: " ".join(base64.b64encode(t).decode()),            # spaces inside
])
def test_basic_credentials_are_read_as_leniently_as_servers_do(encode):
    creds = credentials(secret())
    mine = creds.placeholder("s1", "API_TOKEN")
    with pytest.raises(Leak):
        apply(creds, [("Authorization", "Basic " + encode(f"x:{mine}?".encode()))],
              host=OTHER)


def test_a_secret_set_again_after_rm_has_new_placeholders_a_replaced_one_the_same(tmp_path):
    store = secrets.SecretStore.load(tmp_path)
    store.set(secret())
    first = Credentials(store.key, store.secrets).placeholder("s1", "API_TOKEN")
    store.set(secret(hosts=["api.example.com", "b.example.com"]))  # replaced: still good
    assert Credentials(store.key, store.secrets).placeholder("s1", "API_TOKEN") == first
    store.remove("API_TOKEN")
    store.set(secret())
    again = Credentials(store.key, store.secrets)
    assert again.placeholder("s1", "API_TOKEN") != first  # the old one stays dead
    with pytest.raises(Leak):
        again.apply("s1", API, "/", (("Authorization", f"Bearer {first}"),), True)


def test_a_wildcard_over_a_top_level_domain_is_refused():
    with pytest.raises(secrets.SecretError, match="whole top-level domain"):
        secret(hosts=["*.com"])
    assert secret(hosts=["*.example.com"]).binds("api.example.com")


def test_a_secrets_file_edited_by_hand_is_checked_as_if_set_anew(tmp_path):
    store = secrets.SecretStore.load(tmp_path)
    store.set(secret())
    data = json.loads((tmp_path / secrets.FILE).read_text())
    data["secrets"]["API_TOKEN"]["value"] = "v\r\nX-Injected: 1"
    (tmp_path / secrets.FILE).write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="printable ASCII") as caught:
        secrets.SecretStore.load(tmp_path)
    assert "X-Injected" not in str(caught.value)


def test_a_secret_limited_to_requests_goes_with_those_alone():
    limited = secret(requests=["POST /v1/messages", "GET /v1/models/**"])
    assert limited.requests == ("POST /v1/messages", "GET /v1/models/**")
    creds = credentials(limited)
    mine = creds.placeholder("s1", "API_TOKEN")
    header = [("Authorization", f"Bearer {mine}")]
    for method, target in (("POST", "/v1/messages"), ("GET", "/v1/models/x?y=1"),
                           ("GET", "/v1/models")):
        done = creds.apply("s1", API, target, tuple(header), True, method)
        assert done.headers == (("Authorization", f"Bearer {VALUE}"),), (method, target)
    for method, target in (("GET", "/v1/messages"), ("POST", "/v1/files"),
                           ("POST", "/v1/messages/../files"), ("post", "/v1/messages"),
                           ("POST", "/v1%2Fmessages")):
        with pytest.raises(Leak):  # the placeholder stays, and goes nowhere
            creds.apply("s1", API, target, tuple(header), True, method)
    assert limited.describe()["requests"] == ["POST /v1/messages", "GET /v1/models/**"]


@pytest.mark.parametrize(("requests", "message"), [
    ("POST /x", "must list"), (["post /x"], "request pattern"), (["nothing"], "matches nothing"),
    (["GET /x"] * 33, "at most 32")])
def test_bad_request_limits_are_refused_naming_the_pattern(requests, message):
    with pytest.raises(secrets.SecretError, match=message):
        secret(requests=requests)


def test_request_limits_survive_the_store(tmp_path):
    store = secrets.SecretStore.load(tmp_path)
    store.set(secret(requests=["POST /v1/messages"]))
    again = secrets.SecretStore.load(tmp_path)
    assert again.secrets["API_TOKEN"].requests == ("POST /v1/messages",)


def test_a_limited_secret_goes_only_with_a_request_every_path_it_is_routed_by_allows():
    """Symfony (before 5) and IIS route by X-Original-URL / X-Rewrite-URL: a secret limited
    to `POST /v1/messages` must not go with a request those fields route to /v1/files."""
    creds = credentials(secret(requests=["POST /v1/messages"]))
    header = ("Authorization", f"Bearer {creds.placeholder('s1', 'API_TOKEN')}")
    with pytest.raises(Leak):
        creds.apply("s1", API, "/v1/messages", (header,), True, "POST", (), ("/v1/files",))
    done = creds.apply("s1", API, "/v1/messages", (header,), True, "POST", (),
                       ("/v1/messages",))
    assert done.used == ("API_TOKEN",)
    assert creds.unpermitted(("API_TOKEN",), ["POST"], "/v1/messages", ["/v1/files"])
    assert creds.unpermitted(("API_TOKEN",), ["POST"], "/v1/messages", []) is None


def test_a_value_stored_before_values_had_a_minimum_still_loads(tmp_path):
    """An appliance upgraded with a short value in its store must still start: the value
    works as before (unscanned, as before); setting it again is refused until it is longer."""
    store = secrets.SecretStore.load(tmp_path)
    store.set(secret())
    data = json.loads((tmp_path / secrets.FILE).read_text())
    data["secrets"]["API_TOKEN"]["value"] = "short"
    (tmp_path / secrets.FILE).write_text(json.dumps(data))
    assert secrets.SecretStore.load(tmp_path).secrets["API_TOKEN"].value == "short"
    with pytest.raises(secrets.SecretError, match="at least 8"):
        secret(value="short")


def test_the_store_announces_a_change_once_it_is_committed_and_not_before(tmp_path):
    """As the policy store: planned aside, written, then committed and told to listeners;
    a change that cannot be written is told to no one."""
    store = secrets.SecretStore.load(tmp_path)
    seen: list[list[str]] = []
    store.on_change(lambda: seen.append(sorted(store.secrets)))
    change = store.plan_set(secret())
    assert change.result is True and store.secrets == {} and seen == []
    change.write()
    assert seen == [] and "API_TOKEN" in json.loads(store.path.read_text())["secrets"]
    store.commit(change)
    assert seen == [["API_TOKEN"]]
    store.path = tmp_path / "missing" / "dir" / secrets.FILE
    (tmp_path / "missing").write_text("")  # a directory that is a file: even root fails
    with pytest.raises(OSError):
        store.remove("API_TOKEN")
    assert seen == [["API_TOKEN"]] and list(store.secrets) == ["API_TOKEN"]


def test_a_listener_that_fails_does_not_hide_the_change_from_the_others(tmp_path, caplog):
    store = secrets.SecretStore.load(tmp_path)
    told = []

    def broken():
        raise RuntimeError("a bug")

    store.on_change(broken)
    store.on_change(lambda: told.append(True))
    with pytest.raises(secrets.ListenerFailed, match="1 of the parts that follow it failed"):
        store.set(secret())  # the control call that made it answers with an error
    assert told == [True] and "API_TOKEN" in store.secrets
    assert "API_TOKEN" in json.loads(store.path.read_text())["secrets"]
    assert "a listener failed" in caplog.text
