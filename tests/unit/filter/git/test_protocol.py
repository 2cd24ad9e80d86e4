"""A push's commands, capabilities and options as git's receive-pack reads them, without
sockets: transcripts of command lists, and hostile capability lists checked against a
line-for-line copy of git's own reader (connect.c's parse_feature_value)."""

from __future__ import annotations

import os
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.filter.git import protocol
from appliance.filter.git.protocol import FLUSH, GitProtocolError, pkt, read_push
from tests import fakes

ZERO, ONE, OID256 = "0" * 40, "1" * 40, "2" * 64
GIT_SPACE = b" \t\n\r"
"""git's isspace (ctype.c): space, tab, newline, carriage return; not \\v, not \\f."""
NAMES = (b"report-status", b"report-status-v2", b"side-band-64k", b"side-band", b"quiet",
         b"atomic", b"push-options", b"object-format", b"agent", b"session-id", b"ofs-delta",
         b"delete-refs", b"push-cert")
"""Every capability a push may carry (none is one letter repeated: see the reference)."""


def parse_feature_value(feature_list: bytes, feature: bytes) -> bytes | None:
    """connect.c's parse_feature_value, line for line, on the C string `feature_list` (up to
    its first NUL): the value (b"" for a bare feature), None when it is not there."""
    feature_list = feature_list.split(b"\0", 1)[0]
    at = 0
    while at < len(feature_list):
        found = feature_list.find(feature, at)
        if found < 0:
            return None
        if found == at or feature_list[found - 1] in GIT_SPACE:
            value = found + len(feature)
            if value == len(feature_list) or feature_list[value] in GIT_SPACE:
                return b""
            if feature_list[value] == ord("="):
                end = value + 1
                while end < len(feature_list) and feature_list[end] not in b" \t\n":
                    end += 1
                return feature_list[value + 1 : end]
        at = found + 1
    return None


def line(ref: str, listing: bytes | None = None, new: str = ONE) -> bytes:
    return pkt(f"{ZERO} {new} {ref}".encode() + (b"\0" + listing if listing is not None
                                                 else b"") + b"\n")


# -- capability lists ---------------------------------------------------------------------


@pytest.mark.parametrize(("listing", "expected"), [
    (b"report-status side-band-64k agent=git/2.47.3", {
        "report-status": "", "side-band-64k": "", "agent": "git/2.47.3"}),
    (b"report-status-v2", {"report-status-v2": ""}),  # not report-status
    (b"push-options=1", {"push-options": "1"}),
    (b"push-options= quiet", {"push-options": "", "quiet": ""}),
    (b"agent=a=b\tquiet\rpush-options\natomic", {
        "agent": "a=b", "quiet": "", "push-options": "", "atomic": ""}),
    (b"object-format=sha256\rx", {"object-format": "sha256\rx", "x": ""}),  # a value ends
    # at space, tab or newline only, as git's strcspn(" \t\n") ends it
    (b"quiet\x0bpush-options \x0cquiet", {"quiet\x0bpush-options": "", "\x0cquiet": ""}),
    (b"quiet quiet=1", {"quiet": ""}),  # the first one counts
    (b"  =x  ", {}),
    (b"", {}),
])
def test_a_capability_list_is_read_word_by_word_as_git_reads_it(listing, expected):
    assert protocol.features(listing) == expected


@settings(max_examples=2000)
@given(st.lists(st.sampled_from([*NAMES, b"=", b"1", b"sha256", b"x", b"-v2", b" ", b"\t",
                                 b"\r", b"\n", b"\x0b", b"\x0c", b"\0", b"\xff"]),
                max_size=14).map(b"".join))
def test_every_capability_is_read_as_receive_pack_reads_it(listing):
    """Whatever the list, each capability is there (with the value) exactly when git's own
    reader finds it: in the C string (to the first NUL), a word at the start or after git's
    space, ended by the end, git's space or `=`."""
    found = protocol.features(listing.split(b"\0", 1)[0])
    for name in NAMES:
        value = parse_feature_value(listing, name)
        assert found.get(name.decode()) == (value.decode("latin-1") if value is not None
                                            else None), name


@settings(max_examples=500)
@given(st.lists(st.one_of(st.none(), st.sampled_from(
    [b"report-status", b"push-options", b"push-options=1", b"quiet\tpush-options",
     b"agent=push-options", b"push-optionsx", b"report-status\0push-options", b""])),
    min_size=1, max_size=5))
def test_a_capability_counts_on_any_command_line(listings):
    """receive-pack sets a feature from every command line that carries a list, not only
    the first: the push asks for what any of its lines asks for."""
    body = b"".join(line(f"refs/heads/corral/s1/b{i}", listing)
                    for i, listing in enumerate(listings)) + FLUSH
    asked = any(listing is not None and parse_feature_value(listing, b"push-options")
                is not None for listing in listings)
    push = read_push(body + (FLUSH if asked else b""))
    assert ("push-options" in push.capabilities) == asked
    assert push.pack == len(body) + (4 if asked else 0)  # the (empty) option block read


# -- command lists --------------------------------------------------------------------------


def test_the_options_come_after_the_commands_and_before_the_pack():
    body = (line("refs/heads/a", b"report-status") + line("refs/heads/b", b"push-options")
            + FLUSH + pkt(b"ci.skip\n") + pkt(b"merge_request.title=fix it") + FLUSH)
    push = read_push(body + b"PACK")
    assert [c.ref for c in push.commands] == ["refs/heads/a", "refs/heads/b"]
    assert push.options == ("ci.skip", "merge_request.title=fix it")  # one \n chomped
    assert push.pack == len(body)
    assert push.capabilities == {"report-status", "push-options"}


def test_no_commands_no_options():
    """receive-pack reads the option block only after commands (a lone flush is git's
    probe), and only shallow lines make no commands."""
    shallow = pkt(f"shallow {ONE}".encode())
    assert read_push(FLUSH + b"PACK").pack == 4
    push = read_push(shallow + FLUSH + b"PACK")
    assert push.commands == () and push.pack == len(shallow) + 4


def test_a_shallow_line_carries_no_capabilities():
    """receive-pack passes over a shallow line before it reads a list: one after a NUL
    there asks for nothing."""
    body = pkt(f"shallow {ONE}\0push-options".encode()) + line("refs/heads/a") + FLUSH
    assert read_push(body + b"PACK").capabilities == frozenset()


def test_each_command_lines_object_format_is_read():
    sha256 = read_push(line("refs/heads/a", b"object-format=sha256", OID256) + FLUSH)
    assert sha256.object_format == "sha256"
    assert read_push(line("refs/heads/a", b"quiet") + FLUSH).object_format == "sha1"
    assert read_push(line("refs/heads/a") + FLUSH).object_format is None


@pytest.mark.parametrize(("body", "message"), [
    (line("refs/heads/a", b"object-format=sha256") + line("refs/heads/b", b"quiet") + FLUSH,
     "object formats"),  # a list without one is sha1's
    (line("refs/heads/a", b"object-format=sha256\rx") + FLUSH, "object format"),
    (b"0x1f" + b"x" * 27 + FLUSH, "not a pkt-line length"),  # int() reads it; git does not
    (b" 01f" + b"x" * 27 + FLUSH, "not a pkt-line length"),
    (pkt(b"shallow xyz") + FLUSH, "shallow"),
    (line("refs/heads/a", b"push-options") + FLUSH + pkt(b"ci.skip"), "push options"),
    (line("refs/heads/a", b"push-options") + FLUSH
     + b"".join(pkt(b"o%d" % i) for i in range(protocol.MAX_OPTIONS + 1)) + FLUSH,
     f"more than {protocol.MAX_OPTIONS} push options"),
])
def test_a_command_list_git_does_not_send_is_refused(body, message):
    with pytest.raises(GitProtocolError, match=message):
        read_push(body)


# -- against git's own receive-pack ---------------------------------------------------------


@pytest.fixture(scope="module")
def receive_pack(tmp_path_factory):
    """A real `git receive-pack` (stateless, as git http-backend runs it) on a bare
    repository that advertises push options, with a hook writing the options it is handed;
    and a commit with its pack to push. Returns push(body) -> the options the hook heard."""
    root = tmp_path_factory.mktemp("receive")
    env = {"PATH": os.environ["PATH"], "HOME": str(root), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@b", "GIT_COMMITTER_NAME": "a",
           "GIT_COMMITTER_EMAIL": "a@b"}

    def run(*args, data: bytes | None = None, check: bool = True):
        return subprocess.run(["git", *args], env=env, input=data, capture_output=True,
                              check=check, timeout=60)

    bare, work = root / "remote.git", root / "work"
    run("init", "-q", "--bare", str(bare))
    log = fakes.hear_push_options(bare)
    run("init", "-q", str(work))
    (work / "f").write_text("pushed\n")
    run("-C", str(work), "add", "f")
    run("-C", str(work), "commit", "-q", "-m", "pushed")
    new = run("-C", str(work), "rev-parse", "HEAD").stdout.decode().strip()
    pack = run("-C", str(work), "pack-objects", "--revs", "--stdout", "-q",
               data=f"{new}\n".encode()).stdout

    def push(body: bytes) -> list[str]:
        log.write_text("")
        run("receive-pack", "--stateless-rpc", str(bare), data=body + pack, check=False)
        return fakes.options_heard(log)
    return new, push


@pytest.mark.parametrize(("listings", "read"), [
    ([b"report-status push-options"], True), ([b"report-status", b"push-options"], True),
    ([b"report-status push-options=1"], True), ([b"report-status", b"agent=x\rpush-options"], True),
    ([b"report-status", b"quiet", b"push-options= x"], True),
    ([b"report-status\x0bpush-options"], False), ([b"report-status\0push-options"], False),
    ([b"report-status PUSH-OPTIONS"], False),
], ids=["first", "second", "with-value", "after-cr", "third-empty-value", "after-vt",
        "after-nul", "upper-case"])
def test_the_options_read_are_those_git_hands_its_hooks(receive_pack, listings, read, request):
    """The same bytes to git's receive-pack and to read_push: the options corral reads are
    exactly those the server's hooks are handed (none when git reads no option block)."""
    new, push = receive_pack
    tag = request.node.callspec.id
    options = [f"merge_request.title={tag}".encode(), b"merge_request.target=main"]
    body = b"".join(line(f"refs/heads/corral/s1/{tag}-{i}", listing, new)
                    for i, listing in enumerate(listings))
    body += FLUSH + b"".join(pkt(o) for o in options) + FLUSH
    heard = push(body)
    assert bool(heard) == read
    assert sorted(read_push(body).options) == heard
