"""git's smart HTTP as the proxy reads it, without sockets: which request is git's and for
which repository, a push's commands, the commits of a real pack (made by git itself), and
the verdict with the answer `git push` prints."""

from __future__ import annotations

import gzip
import os
import subprocess

import pytest

from appliance.filter.proxy import git
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
    commits = git.pack_commits(pack(ids["two"], ids["base"]))
    assert set(commits) == {ids["one"], ids["two"]}
    assert git.fast_forward(commits, ids["base"], ids["two"])
    side = git.pack_commits(pack(ids["other"], ids["two"]))
    assert not git.fast_forward(side, ids["two"], ids["other"])


def test_the_verdict_on_pushes(history):
    ids, pack = history
    ref = "refs/heads/corral/s1/work"
    forward = body([(ids["base"], ids["two"], ref)], pack(ids["two"], ids["base"]))
    assert git.judge(forward, SPEC, "s1").allowed
    assert git.judge(git.decode_body(gzip.compress(forward), "gzip"), SPEC, "s1").allowed
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
