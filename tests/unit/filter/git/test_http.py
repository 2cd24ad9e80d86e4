"""git's smart HTTP as the proxy reads it, without sockets: which request is git's and for
which repository, a push's commands, the commits of a real pack (made by git itself), and
the verdict with the answer `git push` prints."""

from __future__ import annotations

import gzip
import hashlib
import os
import subprocess
import zlib

import pytest

from appliance.filter.git import http as git
from appliance.filter.git import pack as packs
from appliance.policy import Policy, parse_host
from appliance.policy.config import ConfigError, parse_policy
from appliance.policy.git import GitSpec
from appliance.policy.targets import Ambiguous

ZERO = "0" * 40
SPEC = GitSpec.parse("acme/widget")


@pytest.mark.parametrize(("target", "expected"), [
    ("/acme/widget.git/info/refs?service=git-upload-pack", ("acme/widget", git.UPLOAD, True)),
    ("/acme/widget/info/refs?service=git-receive-pack", ("acme/widget", git.RECEIVE, True)),
    ("/acme/widget.git/git-receive-pack", ("acme/widget", git.RECEIVE, False)),
    ("/acme/widget.git/git-upload-pack", ("acme/widget", git.UPLOAD, False)),
    ("/acme/widget.git/info/refs", ("acme/widget", git.UPLOAD, True)),  # dumb: reads only
    ("/acme/wid%67et.git/git-receive-pack", ("acme/widget", git.RECEIVE, False)),
    ("/acme/widget.GIT/Git-Receive-Pack", ("acme/widget", git.RECEIVE, False)),
    ("/acme/widget/info/refs?SERVICE=GIT-RECEIVE-PACK", ("acme/widget", git.RECEIVE, True)),
])
def test_git_requests_are_known_by_their_path(target, expected):
    call = git.classify(target)
    assert (call.repo, call.service, call.discovery) == expected


def test_other_requests_are_not_git_and_ambiguous_ones_are_refused():
    assert git.classify("/acme/widget/issues") is None
    for target in ("/acme/widget/info/refs?service=git-receive-pack&service=git-upload-pack",
                   "/acme/widget/info/refs?service=git-shell", "/acme/../x/git-receive-pack"):
        with pytest.raises(Ambiguous):
            git.classify(target)


def test_a_git_table_lists_repositories_and_makes_its_host_inspected():
    document = parse_policy('[http]\nallow = ["git.test"]\n[[git]]\nhost = "git.test"\n'
                            'repos = ["acme/widget", "acme/tools-*"]\n'
                            'push = ["refs/heads/corral/{session}/**", "refs/tags/v*"]\n',
                            "corral.toml", "project")
    assert [r.text for r in document.rules if r.kind == "git"] == [
        "git.test acme/widget refs/heads/corral/{session}/** refs/tags/v*",
        "git.test acme/tools-* refs/heads/corral/{session}/** refs/tags/v*"]
    policy = Policy(document.rules)
    access = policy.git(parse_host("git.test"))
    assert policy.inspection(parse_host("git.test")) is not None
    assert access.repository("acme/tools-cli").pushable("refs/tags/v2", "s1")
    assert access.repository("acme/other") is None and policy.git(parse_host("x.test")) is None


@pytest.mark.parametrize(("text", "message"), [
    ('[[git]]\nhost = "g.test"\n', "name the repositories"),
    ('[[git]]\nhost = "g.test"\nrepos = ["acme/**"]\n', "'**' is not allowed"),
    ('[[git]]\nhost = "g.test"\nrepos = ["a/b"]\npush = ["main"]\n', "name full refs"),
    ('[[git]]\nhost = "g.test"\nrepos = ["a/b"]\npush = ["refs/heads/{user}/*"]\n',
     "placeholder"),
    ('[[git]]\nrepos = ["a/b"]\n', "name the git host"),
    ('[[git]]\nhost = "g.test"\nrepo = ["a/b"]\n', "unknown key"),
])
def test_a_bad_git_table_is_an_error_naming_what_is_wrong(text, message):
    with pytest.raises(ConfigError, match=message.replace("*", r"\*").replace("{", r"\{")):
        parse_policy(text, "corral.toml", "project")


def test_ref_patterns_stay_within_their_segments_and_the_session():
    assert SPEC.pushable("refs/heads/corral/s1/x", "s1")
    assert SPEC.pushable("refs/heads/corral/s1/a/b", "s1")
    assert not SPEC.pushable("refs/heads/corral/s10/x", "s1")
    assert not SPEC.pushable("refs/heads/main", "s1")
    for ref in ("refs/heads/corral/s1/../../main", "refs/heads/corral/s1/x.lock",
                "refs/heads/corral/s1/a..b", "refs/heads/corral/s1/@{x}", "refs/heads/x/"):
        assert not git.valid_ref(ref), ref


# -- pushes made by git itself -----------------------------------------------------------


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    """A repository: base <- one <- two, and `other` (a sibling of two)."""
    root = tmp_path_factory.mktemp("repo")
    env = {"PATH": os.environ["PATH"], "HOME": str(root), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@b", "GIT_COMMITTER_NAME": "a",
           "GIT_COMMITTER_EMAIL": "a@b"}

    def run(*args, data: bytes | None = None) -> bytes:
        return subprocess.run(["git", "-C", str(root), *args], env=env, input=data,
                              capture_output=True, check=True).stdout

    run("init", "-q", "-b", "main")
    ids = {}
    for name in ("base", "one", "two"):
        (root / "f").write_text(name * 50)  # alike: deltas
        run("add", "f")
        run("commit", "-q", "-m", name)
        ids[name] = run("rev-parse", "HEAD").decode().strip()
    run("checkout", "-q", "-b", "side", ids["one"])
    (root / "f").write_text("other" * 50)
    run("commit", "-qam", "other")
    ids["other"] = run("rev-parse", "HEAD").decode().strip()

    def pack(new: str, old: str) -> bytes:
        return run("pack-objects", "--thin", "--stdout", "--revs", "-q",
                   data=f"{new}\n^{old}\n".encode())

    return ids, pack


def body(commands: list[tuple[str, str, str]], pack: bytes = b"",
         caps: str = "report-status side-band-64k") -> bytes:
    lines = [git.pkt(f"{old} {new} {ref}".encode() + (b"\0" + caps.encode() if i == 0 else b"")
                     + b"\n") for i, (old, new, ref) in enumerate(commands)]
    return b"".join(lines) + git.FLUSH + pack


def test_a_real_pack_shows_which_updates_are_fast_forwards(history):
    ids, pack = history
    commits = packs.pack_commits(pack(ids["two"], ids["base"]))
    assert set(commits) == {ids["one"], ids["two"]}
    assert packs.fast_forward(commits, ids["base"], ids["two"])
    side = packs.pack_commits(pack(ids["other"], ids["two"]))
    assert not packs.fast_forward(side, ids["two"], ids["other"])


def test_the_verdict_on_pushes(history):
    ids, pack = history
    ref = "refs/heads/corral/s1/work"
    forward = body([(ids["base"], ids["two"], ref)], pack(ids["two"], ids["base"]))
    assert git.judge(forward, SPEC, "s1").allowed
    assert git.judge(git.decode_body(gzip.compress(forward), ["gzip"]), SPEC, "s1").allowed
    assert git.judge(body([(ZERO, ids["two"], ref)], pack(ids["two"], ids["base"])), SPEC,
                     "s1").allowed  # a new ref: nothing to descend from
    assert git.judge(git.FLUSH, SPEC, "s1").allowed  # git's probe before a large push
    rewrite = git.judge(body([(ids["two"], ids["other"], ref)], pack(ids["other"], ids["two"])),
                        SPEC, "s1")
    assert not rewrite.allowed and "only move a ref forward" in rewrite.reason
    mixed = git.judge(body([(ZERO, ids["two"], ref), (ids["base"], ids["two"],
                                                       "refs/heads/main")],
                           pack(ids["two"], ids["base"])), SPEC, "s1")
    assert [c.ref for c, _ in mixed.refusals] == ["refs/heads/main"]
    answer = git.report(mixed)  # every ref is refused: none reaches the upstream
    assert b"ng refs/heads/main corral: this session may push only" in answer
    assert b"ng refs/heads/corral/s1/work corral: another ref of this push" in answer
    deleted = git.judge(body([(ids["two"], ZERO, ref)]), SPEC, "s1")
    assert "never delete" in deleted.reason
    tagged = git.judge(body([(ids["one"], ids["two"], "refs/tags/v1")]),
                       GitSpec.parse("acme/widget", ("refs/tags/*",)), "s1")
    assert "never move a tag" in tagged.reason


@pytest.mark.parametrize("bad", [b"00", b"zzzz", b"0009abc", b"0030" + b"x" * 44 + b"0000",
                                 b"00a0push-cert\0report-status\n0000"])
def test_a_body_git_would_not_send_is_refused_with_an_error_packet(bad):
    verdict = git.judge(bad, SPEC, "s1")
    assert not verdict.allowed and verdict.error
    assert git.report(verdict).startswith(b"00") and b"ERR corral:" in git.report(verdict)


def test_a_pack_that_lies_is_refused_not_trusted(history):
    ids, pack = history
    ref = "refs/heads/corral/s1/work"
    good = pack(ids["two"], ids["base"])
    for broken in (b"PACK\0\0\0\2\0\0\0\5", good[:40], b"JUNK" + good[4:]):
        verdict = git.judge(body([(ids["base"], ids["two"], ref)], broken), SPEC, "s1")
        assert not verdict.allowed, broken[:20]


# -- what an agent writes to get past the reading ------------------------------------------

EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"


def whole(kind: int, data: bytes, declared: int | None = None) -> bytes:
    """One whole object as a pack holds it: type and size header, then zlib data."""
    size = len(data) if declared is None else declared
    first, size = (kind << 4) | (size & 15), size >> 4
    header = bytearray()
    while size:
        header.append(first | 0x80)
        first, size = size & 0x7F, size >> 7
    header.append(first)
    return bytes(header) + zlib.compress(data)


def make_pack(objects: list[bytes]) -> bytes:
    return b"PACK\0\0\0\2" + len(objects).to_bytes(4, "big") + b"".join(objects)


def commit_id(body: bytes) -> str:
    return hashlib.sha1(b"commit %d\0" % len(body) + body).hexdigest()


def test_a_parent_line_out_of_its_place_is_refused_not_read_as_a_parent():
    old = "1" * 40
    body = (f"tree {EMPTY_TREE}\nauthor a <a@b> 0 +0000\ncommitter a <a@b> 0 +0000\n"
            f"parent {old}\n\nrewritten\n").encode()  # a root commit, as git reads it
    verdict = git.judge(body_of([(old, commit_id(body), "refs/heads/corral/s1/work")],
                                make_pack([whole(packs.COMMIT, body)])), SPEC, "s1")
    assert not verdict.allowed and "parent line out of its place" in verdict.reason


def body_of(commands, pack: bytes) -> bytes:
    return body(commands, pack)


@pytest.mark.parametrize(("pack", "message"), [
    (make_pack([whole(packs.COMMIT, b"x" * (4 << 20), declared=10)]), "declares"),
    # a blob ends the reading before it is inflated: the commits come first
    (make_pack([whole(packs.BLOB, b"x" * (4 << 20), declared=1 << 62)]), "not shown to descend"),
    (make_pack([whole(packs.COMMIT, b"x" * 10, declared=(2 << 20))]), "writes them small"),
    (b"PACK\0\0\0\2\0\0\0\1" + b"\xbf" + b"\xff" * 20_000 + b"\0", "longer than git"),
    (b"PACK\0\0\0\2\xff\xff\xff\xff", "at most"),
])
def test_hostile_packs_are_refused_within_bounds(pack, message):
    verdict = git.judge(body_of([("1" * 40, "2" * 40, "refs/heads/corral/s1/w")], pack),
                        SPEC, "s1")
    assert not verdict.allowed and message in verdict.reason, verdict.reason


def test_a_delta_that_grows_past_what_it_declares_is_refused():
    base = (f"tree {EMPTY_TREE}\nauthor a <a@b> 0 +0000\ncommitter a <a@b> 0 +0000\n\n"
            ).encode() + b"m" * 70_000
    delta = bytes([len(base) & 0x7F | 0x80, (len(base) >> 7) & 0x7F | 0x80, len(base) >> 14,
                   100]) + b"\x80" * 4000  # declares 100 bytes, copies 64 KiB 4000 times
    with pytest.raises(git.GitProtocolError, match="larger than it says"):
        packs.apply_delta(base, delta)


def test_a_push_without_a_session_is_refused():
    assert not git.judge(git.FLUSH, SPEC, None).allowed


def test_encoded_slashes_and_git_paths_outside_the_smart_protocol():
    with pytest.raises(Ambiguous):
        git.classify("/acme/widget.git%2Fgit-receive-pack")
    for target, repo in (("/other/secret.git/HEAD", "other/secret"),
                         ("/other/secret/objects/info/packs", "other/secret"),
                         ("/acme/widget.git/refs/heads/main", "acme/widget"),
                         ("/a/b/info/lfs/objects/batch", "a/b")):
        call = git.classify(target)
        assert (call.repo, call.service) == (repo, git.OTHER), target
    assert git.classify("/acme/widget/blob/main/objects/x.py") is None


def test_the_files_of_a_bare_repository_name_it_for_writes_without_dot_git():
    for target, repo in (("/acme/widget/refs/heads/main", "acme/widget"),
                         ("/acme/widget/packed-refs", "acme/widget"),
                         ("/other/secret/objects/ab/cdef", "other/secret"),
                         ("/other/secret/HEAD", "other/secret"),
                         ("/a/b/info/refs", "a/b")):
        assert git.bare_file(target) == repo, target
    # a forge's own API and pages are not a bare repository's files
    for target in ("/acme/widget/pulls", "/acme", "/api/v4/projects/12/hooks/3",
                   "/api/v1/repos/o/r/hooks/1", "/api/v3/repos/o/r/contents/config",
                   "/acme/widget/refs"):
        assert git.bare_file(target) is None, target


def test_a_push_of_more_commits_than_corral_reads_is_refused(monkeypatch):
    monkeypatch.setattr(packs, "MAX_COMMITS", 3)
    bodies = [(f"tree {EMPTY_TREE}\nauthor a <a@b> {n} +0000\ncommitter a <a@b> 0 +0000\n\n"
               ).encode() for n in range(4)]
    verdict = git.judge(body_of([("1" * 40, commit_id(bodies[-1]), "refs/heads/corral/s1/w")],
                                make_pack([whole(packs.COMMIT, b) for b in bodies])), SPEC, "s1")
    assert not verdict.allowed and "more than 3 commits" in verdict.reason


def test_gzip_is_the_one_encoding_and_one_member():
    data = git.FLUSH
    assert git.decode_body(gzip.compress(data), ["gzip"]) == data
    for encodings, payload in ((["gzip", "gzip"], gzip.compress(data)),
                               (["br"], data),
                               (["gzip"], gzip.compress(data) + gzip.compress(data))):
        with pytest.raises(git.GitProtocolError):
            git.decode_body(payload, encodings)


def test_a_long_report_keeps_to_gits_packet_size():
    commands = [(ZERO, "2" * 40, f"refs/heads/main-{i:04}-" + "x" * 80) for i in range(800)]
    verdict = git.judge(body(commands), SPEC, "s1")
    answer, pos = git.report(verdict), 0
    while pos < len(answer):
        length = int(answer[pos:pos + 4], 16)
        assert length <= 65520
        pos += length or 4


def test_tables_for_one_repository_add_their_push_patterns():
    document = parse_policy('[[git]]\nhost = "g.test"\nrepos = ["acme/*"]\n'
                            '[[git]]\nhost = "g.test"\nrepos = ["acme/widget"]\n'
                            'push = ["refs/heads/feature/**"]\n', "corral.toml", "project")
    access = Policy(document.rules).git(parse_host("g.test"))
    merged = access.repository("acme/widget")
    assert merged.pushable("refs/heads/feature/x", "s1")
    assert merged.pushable("refs/heads/corral/s1/x", "s1")
    assert not access.repository("acme/other").pushable("refs/heads/feature/x", "s1")


@pytest.mark.parametrize("text", [
    '[[git]]\nhost = "g.test"\nrepos = ["acme/widget refs/heads/**"]\n',
    '[workspace]\nexclude = ["x"]\n'])
def test_what_a_table_may_not_smuggle(text):
    with pytest.raises(ConfigError):
        parse_policy(text, "appliance.toml", "appliance")


def test_a_push_that_moves_too_many_refs_or_takes_too_long_is_refused(history):
    ids, pack = history
    many = [(ids["base"], ids["two"], f"refs/heads/corral/s1/b{i}") for i in range(40)]
    verdict = git.judge(body(many, pack(ids["two"], ids["base"])), SPEC, "s1")
    assert "at most 32" in verdict.reason
    slow = git.judge(body([(ids["base"], ids["two"], "refs/heads/corral/s1/w")],
                          pack(ids["two"], ids["base"])), SPEC, "s1", seconds=-1)
    assert "took more than" in slow.reason


def test_limited_secrets_follow_method_overrides():
    from appliance.filter import secrets as store
    from appliance.filter.proxy.credentials import Credentials, Leak
    from appliance.policy import Host

    limited = store.parse({"name": "API_TOKEN", "value": "sk-live-0123456789abcdef",
                           "hosts": ["api.test"], "requests": ["POST /v1/messages"]})
    creds = Credentials(b"k" * 32, {"API_TOKEN": limited})
    header = (("Authorization", f"Bearer {creds.placeholder('s1', 'API_TOKEN')}"),)
    assert creds.apply("s1", Host(name="api.test"), "/v1/messages", header, True, "POST").used
    with pytest.raises(Leak):
        creds.apply("s1", Host(name="api.test"), "/v1/messages", header, True, "POST", ("PUT",))


def _bare_proxy():
    """What Forward reads of its proxy when nothing is relayed: the config and the store's
    change hook."""
    from types import SimpleNamespace

    from appliance.sessionconfig import ProxyConfig
    return SimpleNamespace(config=ProxyConfig(), store=SimpleNamespace(on_change=lambda _: None))


def test_bodies_held_to_be_judged_have_a_budget_per_session_and_in_all():

    from appliance.filter.http import HttpError
    from appliance.filter.proxy import forward

    held = forward.Forward(_bare_proxy())
    first, second, third = [], [], []
    held.hold("s1", forward.HELD_MAX // 2, first)
    with pytest.raises(HttpError) as refused:
        held.hold("s1", 1, second)  # s1's half is full
    assert refused.value.status == 503
    held.hold("s2", forward.HELD_MAX // 2, second)
    with pytest.raises(HttpError):
        held.hold("s3", 1, third)  # everything is
    held.release(first)
    held.hold("s3", 1, third)
    held.hold(None, 5, third)  # no session's: a key of its own, not the total
    held.release(second)
    held.release(third)
    assert held.held == {} and held.held_total == 0


def test_a_session_has_one_judge_at_a_time_and_never_holds_them_all():
    """Two pushes of s1 and one of s2: s1's second waits for its first, s2's is judged."""
    import asyncio

    from appliance.filter.proxy import forward

    async def scenario():
        judges = forward.Forward(_bare_proxy())
        order, release = [], asyncio.Event()

        async def push(session, name):
            async with judges._judge_slot(session):
                order.append(name)
                await release.wait()

        tasks = [asyncio.create_task(push("s1", "s1-first")),
                 asyncio.create_task(push("s1", "s1-second")),
                 asyncio.create_task(push("s2", "s2"))]
        for _ in range(5):
            await asyncio.sleep(0)
        judged_at_once = list(order)
        release.set()
        await asyncio.gather(*tasks)
        return judged_at_once, order, judges.judging_session

    at_once, order, left = asyncio.run(scenario())
    assert at_once == ["s1-first", "s2"]  # s1's second is not holding the other judge
    assert order == ["s1-first", "s2", "s1-second"] and left == {}


# -- push options (git push -o): read where receive-pack reads them ---------------------

OWN = "refs/heads/corral/s1/x"
EMPTY_PACK = b"PACK\0\0\0\2\0\0\0\0" + hashlib.sha1(b"PACK\0\0\0\2\0\0\0\0").digest()
MERGE = (b"merge_request.create", b"merge_request.target=main",
         b"merge_request.merge_when_pipeline_succeeds")


def optioned(listings: list[bytes | None], options=MERGE, refs=None) -> bytes:
    """A push creating a branch of s1's own per listing (None: a line without NUL), then a
    flush, the option block (when `options` is not None) and an empty pack."""
    lines = b""
    for i, listing in enumerate(listings):
        ref = (refs or [f"{OWN}{i}" for i in range(len(listings))])[i]
        lines += git.pkt(f"{ZERO} {'1' * 40} {ref}".encode()
                         + (b"\0" + listing if listing is not None else b"") + b"\n")
    block = b"".join(git.pkt(o) for o in options) + git.FLUSH if options is not None else b""
    return lines + git.FLUSH + block + EMPTY_PACK


@pytest.mark.parametrize("listings", [
    [b"report-status side-band-64k push-options"],  # what `git push -o` sends
    [b"report-status", b"push-options"],  # on a later line: receive-pack reads every one
    [b"report-status push-options=1"],  # feature=value: the feature all the same
    [b"report-status", None, b"agent=x\rpush-options=yes"],  # \r is git's space too
    [b"report-status\tpush-options"],
], ids=["first-line", "later-line", "with-value", "after-cr", "after-tab"])
def test_push_options_are_refused_wherever_receive_pack_would_read_them(listings):
    """GitLab would merge the session's branch into main: the options name a merge request
    and its target. Refused whole, naming the first option, in git's report."""
    verdict = git.judge(optioned(listings), SPEC, "s1")
    assert not verdict.allowed
    assert "push option 'merge_request.create'" in verdict.reason, verdict.reason
    assert verdict.options == tuple(o.decode() for o in MERGE)
    report = git.report(verdict)
    assert b"ng refs/heads/corral/s1/x0 corral: push option 'merge_request.create'" in report


@pytest.mark.parametrize("listings", [
    [b"report-status push-optionsx"], [b"report-status xpush-options"],
    [b"report-status agent=push-options"], [b"report-status\x0bpush-options"],  # \v: not
    [b"report-status\0push-options"],  # after a second NUL: the C string ended
    [b"report-status PUSH-OPTIONS"],  # compared as written
], ids=["suffix", "prefix", "a-value", "after-vt", "after-nul", "upper-case"])
def test_what_receive_pack_does_not_read_as_push_options_is_not_read_as_them(listings):
    """No option block follows: what comes after the flush is the pack, for corral as for
    the server."""
    verdict = git.judge(optioned(listings, options=None), SPEC, "s1")
    assert verdict.allowed, verdict.reason


def test_push_options_the_git_table_names_pass_and_others_are_refused_by_name():
    spec = GitSpec.parse("acme/widget", None, ("ci.skip", "merge_request.title=*"))
    allowed = optioned([b"report-status push-options"],
                       (b"ci.skip", b"merge_request.title=fix the parser"))
    assert git.judge(allowed, spec, "s1").allowed
    refused = git.judge(optioned([b"report-status push-options"],
                                 (b"ci.skip", b"ci.variable=X=1", b"merge_request.create")),
                        spec, "s1")
    assert not refused.allowed and refused.options == ("ci.variable=X=1",
                                                       "merge_request.create")
    assert "push option 'ci.variable=X=1' (and 1 more)" in refused.reason
    assert git.judge(optioned([b"push-options"], ()), SPEC, "s1").allowed  # none sent
    # the refs are judged as ever: an allowed option carries no ref through
    to_main = git.judge(optioned([b"report-status push-options"], (b"ci.skip",),
                                 refs=["refs/heads/main"]), spec, "s1")
    assert "may push only" in to_main.reason


@pytest.mark.parametrize(("option", "message"), [
    (b"ci.skip\0merge_request.create", "control character"),
    (b"ci.skip\nmerge_request.create", "control character"),
    (b"ci.skip\x1b[2J", "control character"),
    (b"ci.\xffskip", "not UTF-8"),
])
def test_an_option_git_does_not_send_is_refused_unread(option, message):
    spec = GitSpec.parse("acme/widget", None, ("ci.*",))
    verdict = git.judge(optioned([b"report-status push-options"], (option,)), spec, "s1")
    assert not verdict.allowed and message in verdict.reason, verdict.reason
    assert b"\x1b" not in git.report(verdict)


def test_an_option_shown_in_a_reason_is_escaped_and_cut():
    option = "merge_request.title=" + "\u202e" + "x" * 300
    verdict = git.judge(optioned([b"push-options"], (option.encode(),)), SPEC, "s1")
    assert "\u202e" not in verdict.reason and "\\u202e" in verdict.reason
    assert len(verdict.reason) < 300 and "x" * 80 not in verdict.reason


@pytest.mark.parametrize(("text", "message"), [
    ('push_options = ["ci skip"]', "without spaces"),
    ('push_options = ["*"]', "every option"),
    ('push_options = ["**"]', "every option"),
    ('push_options = [""]', "without spaces"),
    ('push_options = ["ci.skip\\u0007"]', "printable ASCII"),
    ('push_options = "ci.skip"', "list of strings"),
])
def test_a_bad_push_option_pattern_is_an_error_naming_file_line_and_key(text, message):
    with pytest.raises(ConfigError, match=message) as raised:
        parse_policy(f'[[git]]\nhost = "g.test"\nrepos = ["a/b"]\n{text}\n', "corral.toml",
                     "project")
    assert raised.value.line == 4 and raised.value.key == "[[git]] push_options"
    assert str(raised.value).startswith("corral.toml:4: [[git]] push_options:")


def test_push_options_of_tables_add_up_and_keep_to_their_rule_text():
    document = parse_policy('[[git]]\nhost = "g.test"\nrepos = ["acme/*"]\n'
                            'push_options = ["ci.skip"]\n'
                            '[[git]]\nhost = "g.test"\nrepos = ["acme/widget"]\n'
                            'push_options = ["merge_request.title=*"]\n',
                            "corral.toml", "project")
    assert [r.text for r in document.rules] == [
        "g.test acme/* -o ci.skip", "g.test acme/widget -o merge_request.title=*"]
    access = Policy(document.rules).git(parse_host("g.test"))
    merged = access.repository("acme/widget")
    assert merged.push_option("ci.skip") and merged.push_option("merge_request.title=x y")
    assert not merged.push_option("merge_request.create")
    assert not access.repository("acme/other").push_option("merge_request.title=x")
    from appliance.policy.rules import Rule
    again = Rule.parse("git", "g.test acme/widget refs/heads/x/** -o ci.skip", "session")
    assert again.git.pushes == ("refs/heads/x/**",) and again.git.push_options == ("ci.skip",)
    assert again.text == "g.test acme/widget refs/heads/x/** -o ci.skip"
