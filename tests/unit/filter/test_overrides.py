"""The methods and paths a request asks its origin to read it as, without sockets: field
names as CGI/WSGI/Puma fold them, parameter names as PHP-style parsers key them, and the
bodies server stacks parse (overrides.py), read as the origin decodes them (content.py)."""

from __future__ import annotations

import gzip
import json
import zlib
from urllib.parse import quote, urlencode

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.filter.http import parse_request
from appliance.filter.proxy import content, overrides
from appliance.filter.proxy.reading import examine


def head(fields: str = "", line: str = "POST /x HTTP/1.1"):
    return parse_request(f"{line}\r\nHost: a.test\r\n{fields}\r\n".encode())


@pytest.mark.parametrize(("name", "read"), [
    ("X-HTTP-Method-Override", True), ("x_http_method_override", True),
    ("X-Http_Method-OVERRIDE", True), ("X-HTTP-Method", True), ("X_Method_Override", True),
    ("X-HTTP-Method-Overrides", False), ("X-Method", False),
])
def test_override_field_names_fold_case_and_underscores(name, read):
    found = overrides.header_methods(head(f"{name}: delete, PATCH\r\n"))
    assert [m for _, m in found] == (["DELETE", "PATCH"] if read else [])


@pytest.mark.parametrize(("name", "key"), [
    ("_method", "_method"), (".method", "_method"), (" _method", "_method"),
    ("   .method", "_method"), ("[method", "_method"), ("_method[]", "_method"),
    ("_method[a][b]", "_method"), ("_METHOD", "_method"), ("_method_", "_method_"),
    ("x_method", "x_method"), ("_meth od", "_meth_od"), ("a[_method]", "a"),
])
def test_parameter_names_are_keyed_as_php_style_parsers_key_them(name, key):
    assert overrides.parameter_name(name) == key


@pytest.mark.parametrize("query", [
    "_method=DELETE", "a=1&_method=delete", "a=1;_method=DELETE", "%5Fmethod=DELETE",
    "+_method=DELETE", "%20_method=DELETE", ".method=DELETE", "%2Emethod=DELETE",
    "[method=DELETE", "_method[]=DELETE", "_m%65thod=DELETE", "_method=DE%4CETE",
])
def test_every_spelling_of_method_in_a_query_or_form_is_found(query):
    assert [m for _, m in overrides.form_methods(query, "q")] == ["DELETE"]


@pytest.mark.parametrize("query", ["method=DELETE", "title=_method", "x=_method=DELETE",
                                   "_methods=DELETE", "a[_method]=DELETE"])
def test_names_no_stack_reads_as_method_are_not(query):
    assert overrides.form_methods(query, "q") == []


@pytest.mark.parametrize(("content_type", "kinds"), [
    (None, {"form"}), ("application/x-www-form-urlencoded", {"form"}),
    ("Application/X-WWW-Form-Urlencoded; charset=utf-8", {"form"}),
    ("multipart/form-data; boundary=x", {"multipart"}), ("application/json", {"json"}),
    ("application/vnd.github+json", {"json"}), ("text/plain", set()),
    ("text/plain, application/json", {"json"}), ("application/octet-stream", set()),
])
def test_which_bodies_a_stack_parses_follows_every_content_type(content_type, kinds):
    fields = f"Content-Type: {content_type}\r\n" if content_type else ""
    assert overrides.body_kinds(head(fields)) == kinds


def multipart(fields: list[tuple[str, str]], mark: str = "zz", eol: str = "\r\n",
              extra: str = "") -> bytes:
    out = "".join(f"--{mark}{eol}Content-Disposition: form-data; {name}{eol}{extra}{eol}"
                  f"{value}{eol}" for name, value in fields)
    return f"preamble{eol}{out}--{mark}--{eol}epilogue".encode()


@pytest.mark.parametrize("body", [
    multipart([('name="_method"', "DELETE")]),
    multipart([('name="a"', "1"), ('name="_method"', "DELETE")], eol="\n"),
    multipart([('NAME="_method"', "DELETE")]),
    multipart([('name=_method', "DELETE")]),
    multipart([("name*=utf-8''%5Fmethod", "DELETE")]),
    multipart([('name="x"; name="_method"', "DELETE")]),
    multipart([('name="_method"', "REVMRVRF")], extra="Content-Transfer-Encoding: base64\r\n"),
    multipart([('name="_method"', "=44ELETE")],
              extra="Content-Transfer-Encoding: quoted-printable\r\n"),
])
def test_a_multipart_method_part_is_found_in_every_form(body):
    found = overrides.body_methods(body, head("Content-Type: multipart/form-data; "
                                              "boundary=zz\r\n"))
    assert [m for _, m in found] == ["DELETE"]


@pytest.mark.parametrize("body", [
    b'{"_method": "DELETE"}', b'{"a": 1, "_method": "delete"}',
    b'{"_method": "GET", "_method": "DELETE"}', b'\xef\xbb\xbf{"_method": "DELETE"}',
    '{"_method": "DELETE"}'.encode("utf-16"), b'{"_METHOD": "DELETE"}',
])
def test_a_json_method_key_is_found_however_the_document_is_written(body):
    found = overrides.body_methods(body, head("Content-Type: application/json\r\n"))
    assert "DELETE" in [m for _, m in found]


@pytest.mark.parametrize("body", [b'{"a": {"_method": "DELETE"}}', b'["_method", "DELETE"]',
                                  b'{"_method": ["DELETE"]}', b'{"method": "DELETE"}'])
def test_json_that_no_stack_reads_an_override_from_passes(body):
    assert overrides.body_methods(body, head("Content-Type: application/json\r\n")) == []


@pytest.mark.parametrize(("fields", "body"), [
    ("Content-Type: application/json\r\n", b'{"_method": "DELETE",'),
    ("Content-Type: application/json\r\n", '{"_method": '.encode("utf-16")),
    ("Content-Type: multipart/form-data\r\n", b"--zz\r\nname=_method\r\n\r\nDELETE\r\n"),
    ("Content-Type: multipart/form-data; boundary=zz\r\n", b"--zz\r\nno colon, _method\r\n"),
])
def test_a_body_that_cannot_be_parsed_and_mentions_method_is_unreadable(fields, body):
    with pytest.raises(content.Unreadable):
        overrides.body_methods(body, head(fields))


def test_a_body_that_cannot_be_parsed_and_says_nothing_of_methods_passes():
    assert overrides.body_methods(b"{not json", head("Content-Type: application/json\r\n")) == []


@given(st.sampled_from(["_method", ".method", " _method", "[method", "_method[]", "_METHOD"]),
       st.sampled_from(["DELETE", "delete", "Delete"]),
       st.lists(st.tuples(st.text("abcxyz", min_size=1), st.text(max_size=8)), max_size=4),
       st.sampled_from(["form", "query", "multipart", "json"]))
def test_whatever_surrounds_it_an_override_is_found(name, method, others, where):
    if where == "json":
        body, fields = json.dumps({**dict(others), name: method}).encode(), \
            "Content-Type: application/json\r\n"
    elif where == "multipart":
        body = multipart([(f'name="{k}"', v) for k, v in others]
                         + [(f'name="{name}"', method)])
        fields = "Content-Type: multipart/form-data; boundary=zz\r\n"
    else:
        body, fields = urlencode([*others, (name, method)]).encode(), ""
    if where == "query":
        assert "DELETE" in [m for _, m in overrides.form_methods(body.decode(), "q")]
    else:
        assert "DELETE" in [m for _, m in overrides.body_methods(body, head(fields))]


# -- content codings ---------------------------------------------------------------------------


def _raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-15)
    return packer.compress(data) + packer.flush()


@pytest.mark.parametrize(("codings", "encode"), [
    (["gzip"], gzip.compress), (["x-gzip"], gzip.compress), (["deflate"], zlib.compress),
    (["deflate"], _raw_deflate), (["gzip", "deflate"], lambda d: zlib.compress(gzip.compress(d))),
    (["gzip"], lambda d: gzip.compress(d[:3]) + gzip.compress(d[3:])),
])
def test_declared_codings_are_undone_last_first(codings, encode):
    assert content.decode(encode(b"_method=DELETE"), codings, 1 << 20) == b"_method=DELETE"


def test_codings_are_read_from_every_field_in_order_without_identity():
    fields = "Content-Encoding: GZIP, identity\r\nContent-Encoding: deflate\r\n"
    assert content.codings(head(fields)) == ["gzip", "deflate"]


@pytest.mark.parametrize(("codings", "body", "complaint"), [
    (["br"], b"\x0b\x02\x80hi\x03", "cannot decode"),
    (["gzip"], b"plain", "not valid gzip"),
    (["gzip"], gzip.compress(b"abc")[:-3], "ends before"),
    (["gzip"], gzip.compress(b"abc") + b"xx", "after the gzip stream"),
    (["deflate"], zlib.compress(b"abc") + b"xx", "after the deflate stream"),
    (["gzip"], gzip.compress(b"a" * 2000), "expands past 1000 bytes"),
    (["gzip", "gzip"], gzip.compress(gzip.compress(b"\0" * (1 << 22))), "times its size"),
])
def test_what_cannot_be_decoded_within_bounds_is_unreadable(codings, body, complaint):
    with pytest.raises(content.Unreadable, match=complaint):
        content.decode(body, codings, 1000 if "past 1000" in complaint else 1 << 30)


def test_examine_scans_what_the_origin_inflates_and_finds_what_it_asks_for():
    from appliance.filter.proxy.leaks import Leaks

    fields = "Content-Type: application/x-www-form-urlencoded\r\nContent-Encoding: gzip\r\n"
    reading = examine(gzip.compress(b"_method=PATCH&a=AKIAIOSFODNN7EXAMPLE"), head(fields),
                      Leaks({}), methods=True)
    assert reading.finding is not None and "gzip-decoded" in reading.finding.where
    reading = examine(gzip.compress(b"_method=PATCH"), head(fields), Leaks({}), methods=True)
    assert reading.methods == (("a _method field of the form body", "PATCH"),)
    assert examine(b"_method=PATCH", head(fields), None, methods=False).refusal is not None
    reading = examine(quote("_method=PATCH").encode(), head(), None, methods=False)
    assert reading == type(reading)()


def test_a_multipart_body_of_more_parts_than_a_server_reads_is_unreadable():
    body = b"--zz\r\n\r\nx\r\n" * (content.MAX_PARTS + 1) + b"--zz--\r\n"
    with pytest.raises(content.Unreadable, match="more than 1000 parts"):
        content.parts(body, "zz")
    assert len(content.parts(b"--zz\r\n\r\nx\r\n" * content.MAX_PARTS + b"--zz--\r\n",
                             "zz")) == content.MAX_PARTS


@pytest.mark.parametrize(("fields", "size", "costly"), [
    ("", 1000, False),  # a small form: parsed on the loop
    ("", 4000, True),  # a larger one: on a thread
    ("Content-Type: text/plain\r\n", 60 << 10, False),  # scanned only: a regex pass
    ("Content-Type: text/plain\r\n", 70 << 10, True),
    ("Content-Type: multipart/form-data; boundary=zz\r\n", 4000, True),
    ("Content-Encoding: gzip\r\nContent-Type: text/plain\r\n", 10, True),
])
def test_bodies_that_may_hold_the_loop_for_more_than_a_millisecond_are_read_off_it(
        fields, size, costly):
    from appliance.filter.proxy.reading import costly as is_costly

    assert is_costly(b"x" * size, head(fields), methods=True) is costly


def test_a_request_asking_to_be_read_in_more_ways_than_any_client_does_is_refused():
    from appliance.filter.proxy.pipeline import Route, judge_asked
    from appliance.policy import Host
    from appliance.policy.config import parse_policy
    from appliance.policy.decide import Policy

    rules = parse_policy('[[inspect]]\nhost = "a.test"\ndeny = ["DELETE /**"]\n', "t", "project")
    inspection = Policy(rules.rules).inspection(Host(name="a.test"))
    where = Route(Host(name="a.test"), 443, "/x")
    many = [("a field", f"M{i}") for i in range(9)] + [("a field", "GET")] * 500
    refused = judge_asked(inspection, head(), where, many)
    assert refused is not None and "more than 8" in refused.reason
    assert judge_asked(inspection, head(), where, [("a field", "GET")] * 500) is None
