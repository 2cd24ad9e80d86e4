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


# -- as other stacks read them: each request below is a DELETE to some stack ---------------


@pytest.mark.parametrize("name", ["X.HTTP.Method.Override", "X+HTTP+Method+Override",
                                  "X~HTTP~Method~Override", "x|http|method|override"])
def test_override_field_names_fold_as_lighttpd_folds_them(name):
    # lighttpd's CGI and FastCGI name a field's variable with every character that is not a
    # letter or a digit as '_': HTTP_X_HTTP_METHOD_OVERRIDE to the PHP behind it
    found = overrides.header_methods(head(f"{name}: DELETE\r\n"))
    assert [m for _, m in found] == ["DELETE"]
    assert overrides.header_paths(head(f"{name.replace('HTTP-Method-Override', 'x')}: /a\r\n"
                                       f"X.Original.URL: /admin\r\n")) == [
        ("the X.Original.URL field", "/admin")]


@pytest.mark.parametrize("query", [
    "_method%00x=DELETE",  # PHP: a name is a C string, cut at its NUL
    "_method%00=DELETE",
    "[_method]=DELETE",  # Rack 2 and qs (Express's extended forms): leading brackets dropped
    "]_method=DELETE", "[[_method]]=DELETE", "_method]=DELETE",
])
def test_a_method_parameter_is_found_as_php_rack_and_qs_key_it(query):
    assert [m for _, m in overrides.form_methods(query, "q")] == ["DELETE"]


def test_a_value_is_upper_cased_as_unicode_aware_stacks_do():
    # Rack's String#upcase and Java's toUpperCase map U+0131 to I and U+017F to S
    found = overrides.form_methods("_method=opt%C4%B1ons&_method=po%C5%BFt", "q")
    assert [m for _, m in found] == ["OPTIONS", "POST"]


@pytest.mark.parametrize(("content_type", "kind"), [
    ("", "form"),  # Rack reads a POST with an empty Content-Type as a form
    ("   ", "form"),
    ("application/x-www-form-urlencoded xyz", "form"),  # PHP cuts the type at a space
    ("multipart/form-data xyz; boundary=zz", "multipart"),
    ("text/plain; x=/json", "json"),  # Laravel: any type that contains /json or +json
    ("application/jsonx", "json"), ("text/plain+json; a=b", "json"),
])
def test_body_kinds_are_read_as_rack_php_and_laravel_read_the_type(content_type, kind):
    assert kind in overrides.body_kinds(head(f"Content-Type: {content_type}\r\n"))


def _part(head_lines: str, value: str = "DELETE", mark: str = "zz") -> str:
    return f"--{mark}\r\n{head_lines}\r\n\r\n{value}\r\n"


@pytest.mark.parametrize(("content_type", "body"), [
    # PHP takes the first "boundary" anywhere in the type, up to the next '='
    ("multipart/form-data; xboundary=php; boundary=zz",
     _part('Content-Disposition: form-data; name="_method"', mark="php") + "--php--\r\n"),
    ("multipart/form-data; boundaryx; y=php; boundary=zz",
     _part('Content-Disposition: form-data; name="_method"', mark="php") + "--php--\r\n"),
    # Rack the last "boundary=", whatever parameter it ends
    ("multipart/form-data; boundary=zz; xboundary=rack",
     _part('Content-Disposition: form-data; name="_method"', mark="rack") + "--rack--\r\n"),
    # Commons FileUpload (Tomcat) splits parameters on ',' too, and the last one wins
    ("multipart/form-data; boundary=zz, boundary=tc",
     _part('Content-Disposition: form-data; name="_method"', mark="tc") + "--tc--\r\n"),
    # ... and undoes RFC 2231 and RFC 2047 encodings in them
    ("multipart/form-data; boundary*=utf-8''tc",
     _part('Content-Disposition: form-data; name="_method"', mark="tc") + "--tc--\r\n"),
    ('multipart/form-data; boundary="=?utf-8?B?dGM=?="',
     _part('Content-Disposition: form-data; name="_method"', mark="tc") + "--tc--\r\n"),
])
def test_a_multipart_body_is_split_on_every_boundary_a_server_reads(content_type, body):
    found = overrides.body_methods(body.encode(), head(f"Content-Type: {content_type}\r\n"))
    assert "DELETE" in [m for _, m in found]


@pytest.mark.parametrize("body", [
    # PHP reads on after the close delimiter, from the next line that is a delimiter
    _part('Content-Disposition: form-data; name="a"', "1") + "--zz--\r\n"
    + _part('Content-Disposition: form-data; name="_method"') + "--zz--\r\n",
    # PHP, Commons FileUpload and Go unfold a field continued on the next line
    _part('Content-Disposition: form-data; x=y;\r\n name="_method"; z="a:b"') + "--zz--",
    _part('Content-Disposition: form-data;\r\n\tname=_method; z="a:b"') + "--zz--",
    # Rack names a part by its Content-ID when no Content-Disposition names it ...
    _part("Content-ID: _method") + "--zz--",
    # ... finds "Content-Disposition:" anywhere in the part's head, and the last name= in it
    _part('X-A: Content-Disposition: form-data; name=_method\r\n'
          'Content-Disposition: form-data; name="a"') + "--zz--",
    _part('Content-Disposition: form-data; name="a"; x="; name=_method"') + "--zz--",
    # PHP quotes with ' too, ends an unquoted value at a space, and splits on ';' in quotes
    _part("Content-Disposition: form-data; name='_method'") + "--zz--",
    _part("Content-Disposition: form-data; name=_method x") + "--zz--",
    _part('Content-Disposition: form-data; name="x;name=_method;y"') + "--zz--",
    # Commons FileUpload (Tomcat, Spring's HiddenHttpMethodFilter) decodes RFC 2047 words
    _part('Content-Disposition: form-data; name="=?UTF-8?B?X21ldGhvZA==?="') + "--zz--",
    _part('Content-Disposition: form-data; name="=?utf-8?q?=5Fmethod?="') + "--zz--",
])
def test_a_multipart_method_part_is_found_as_php_rack_and_tomcat_find_it(body):
    found = overrides.body_methods(body.encode(), head("Content-Type: multipart/form-data; "
                                                       "boundary=zz\r\n"))
    assert "DELETE" in [m for _, m in found]


@pytest.mark.parametrize(("content_type", "body"), [
    # Tomcat and Jetty decode a form's names and values in the charset its type declares
    # (Tomcat: each name and value percent-decoded, then decoded; Jetty: a UTF-16 body
    # decoded whole first)
    ("application/x-www-form-urlencoded; charset=utf-16be",
     quote("_method".encode("utf-16-be")).encode() + b"="
     + quote("DELETE".encode("utf-16-be")).encode()),
    ("application/x-www-form-urlencoded; charset=UTF-16",
     "_method=DELETE".encode("utf-16")),
    ("multipart/form-data; boundary=zz; charset=utf-16le",
     _part('Content-Disposition: form-data; name="_method"').replace(
         "DELETE", "\0".join("DELETE") + "\0").encode() + b"--zz--"),
])
def test_a_form_is_read_in_the_charset_it_declares(content_type, body):
    found = overrides.body_methods(body, head(f"Content-Type: {content_type}\r\n"))
    assert "DELETE" in [m for _, m in found]


def test_benign_bodies_stay_readable_and_name_no_method():
    webkit = "----WebKitFormBoundary7MA4YWxkTrZu0gW"
    body = (_part('Content-Disposition: form-data; name="payment_method"', "card", webkit)
            + _part('Content-Disposition: form-data; name="file"; filename="a.txt"\r\n'
                    "Content-Type: text/plain", "hello, world", webkit) + f"--{webkit}--\r\n")
    found = overrides.body_methods(body.encode(), head(
        f"Content-Type: multipart/form-data; boundary={webkit}\r\n"))
    assert found == []
    form = "payment_method=card&http.method=x&a_method=y&method=z&title=_method"
    assert overrides.body_methods(form.encode(), head(
        "Content-Type: application/x-www-form-urlencoded; charset=utf-8\r\n")) == []


def test_a_body_of_many_tiny_gzip_members_is_refused_quickly_and_a_few_are_read_whole():
    """Each member's output was appended to all before it (bytes +=), and each member copies
    what follows it: 16,000 members of 160 bytes took 1.6 s, a 1 MiB body of them ~30 s of
    a judge's thread."""
    import time

    member = gzip.compress(b"\0" * 160, mtime=0)
    start = time.perf_counter()
    with pytest.raises(content.Unreadable, match="members"):
        content.decode(member * 16000, ["gzip"], 8 << 20)
    assert time.perf_counter() - start < 0.1
    few = content.MAX_MEMBERS
    assert content.decode(member * few, ["gzip"], 8 << 20) == b"\0" * 160 * few


@pytest.mark.parametrize("disposition", ['name="file"; filename="_method.txt"',
                                         'name="payment[_method]"', 'name="a][_method]"'])
def test_a_file_or_a_key_named_for_the_override_is_not_read_as_one(disposition):
    body = _part(f"Content-Disposition: form-data; {disposition}", "hello, world") + "--zz--"
    assert overrides.body_methods(body.encode(), head("Content-Type: multipart/form-data; "
                                                      "boundary=zz\r\n")) == []


def test_a_part_named_with_leading_brackets_is_read_as_rack_2_reads_it():
    body = _part("Content-Disposition: form-data; name=[_method]") + "--zz--"
    found = overrides.body_methods(body.encode(), head("Content-Type: multipart/form-data; "
                                                       "boundary=zz\r\n"))
    assert "DELETE" in [m for _, m in found]


@pytest.mark.parametrize(("content_type", "encoding"), [
    ("application/json", "utf-16"),  # JSON parsers detect UTF-16 and -32 by themselves
    ("application/json", "utf-32-le"),
    ("text/plain; charset=utf-16be", "utf-16-be"),  # a declared charset: decoded by it
    ("application/x-www-form-urlencoded; charset=UTF-32", "utf-32"),
])
def test_a_body_in_a_charset_that_hides_ascii_is_scanned_as_the_origin_decodes_it(
        content_type, encoding):
    from appliance.filter.proxy.leaks import Leaks

    body = '{"note": "AKIAIOSFODNN7EXAMPLE"}'.encode(encoding)
    reading = examine(body, head(f"Content-Type: {content_type}\r\n"), Leaks({}), methods=False)
    assert reading.finding is not None and "AWS" in reading.finding.detector


@pytest.mark.parametrize("where", ["query", "form", "multipart"])
def test_asp_net_mvc_reads_the_override_fields_name_as_a_parameter_too(where):
    """System.Web.Mvc's GetHttpMethodOverride: the X-HTTP-Method-Override header, else a
    form field of that name, else a query parameter (names in any case)."""
    if where == "query":
        found = overrides.form_methods("x-http-method-override=DELETE", "q")
    elif where == "form":
        found = overrides.body_methods(b"a=1&X-HTTP-Method-Override=DELETE", head())
    else:
        body = _part('Content-Disposition: form-data; name="X-HTTP-Method-Override"')
        found = overrides.body_methods((body + "--zz--").encode(), head(
            "Content-Type: multipart/form-data; boundary=zz\r\n"))
    assert [m for _, m in found] == ["DELETE"]


@pytest.mark.parametrize("disposition", [
    'name*0="_me"; name*1="thod"',  # Go's mime.ParseMediaType joins RFC 2231 continuations
    "name*0*=utf-8''%5Fme; name*1=thod",
    'name="x"; name*0=_met; name*1=h; name*2=od',
])
def test_a_part_name_in_rfc_2231_continuations_is_joined_as_go_joins_it(disposition):
    """gorilla/handlers' HTTPMethodOverrideHandler reads r.FormValue("_method"), and Go
    names a multipart part by its continued `name*0`, `name*1`... parameters."""
    body = _part(f"Content-Disposition: form-data; {disposition}") + "--zz--"
    found = overrides.body_methods(body.encode(), head("Content-Type: multipart/form-data; "
                                                       "boundary=zz\r\n"))
    assert "DELETE" in [m for _, m in found]
