"""git confined to the session, for real: the git client, through the filter (explicit
proxy, TLS ended with the interception CA), to `git http-backend` behind a TLS origin. A
[[git]] table lists one repository; fetch and clone of it work, a push works only onto new
or fast-forwarded refs under refs/heads/corral/<session>/, and every other push is refused
with its reason printed by `git push` itself, the server's refs untouched."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from appliance.filter.git import http as git
from tests import fakes

from .test_inspect import (  # noqa: F401  (fixtures)
    InProcessFilter,
    World,
    client_context,
    get,
    inspect_config,
    interception,
    origins,
    tls_through,
)

POLICY = """
[http]
allow = ["git.test:*"]

[[git]]
host = "git.test"
repos = ["acme/widget"]
"""


class GitClient:
    """The agent's side: real git in `work`, with `env`; the server's bare repositories in
    `root`; a `filter` and a `server` to stop (here over HTTPS, test_sshgate.py over SSH)."""

    def run(self, *args, cwd: Path | None = None, check: bool = True):
        done = subprocess.run(["git", *args], cwd=cwd, env=self.env, capture_output=True,
                              text=True, timeout=60)
        if check and done.returncode:
            raise AssertionError(f"git {' '.join(args)} failed:\n{done.stderr}")
        return done

    def refs(self, repo: str = "acme/widget") -> dict[str, str]:
        return fakes.GitHttp.refs(self.root / f"{repo}.git")

    def commit(self, message: str) -> str:
        (self.work / "notes").write_text(message + "\n")
        self.run("add", "notes", cwd=self.work)
        self.run("commit", "-q", "-m", message, cwd=self.work)
        return self.run("rev-parse", "HEAD", cwd=self.work).stdout.strip()

    def push(self, *args):
        return self.run("push", "origin", *args, cwd=self.work, check=False)

    def close(self):
        self.filter.stop()
        self.server.close()


class Git(GitClient):
    """A git origin on the World's address, and a filter whose session s1 may reach it."""

    def __init__(self, origins: World, interception: Path, root: Path):  # noqa: F811
        self.context = client_context(interception)
        self.root = root / "repos"
        self.root.mkdir()
        fakes.GitHttp.seed(self.root, ["acme/widget", "other/secret"])
        self.home = root / "home"
        self.home.mkdir()
        (self.home / ".gitconfig").write_text(
            "[user]\n\tname = agent\n\temail = agent@corral.test\n"
            "[init]\n\tdefaultBranch = main\n[protocol]\n\tversion = 2\n")
        origins.dns.zone["git.test"] = [("A", World.ADDRESS, 300)]
        self.server = fakes.GitHttp(origins.loop, self.root,
                                    origins.ca.server_context(["git.test"]), World.ADDRESS)
        config = inspect_config(interception, origins.ca.ca_path)
        directory = root / "filter"
        directory.mkdir()
        self.filter = InProcessFilter(directory, origins.dns.address, "asyncio", config, POLICY)
        self.env = {"PATH": os.environ["PATH"], "HOME": str(self.home),
                    "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0",
                    "GIT_SSL_CAINFO": str(interception / "intercept-ca.crt"),
                    "https_proxy": f"http://127.0.0.1:{self.filter.proxy_port}"}
        self.work = root / "work"

    def url(self, repo: str) -> str:
        return f"https://git.test:{self.server.port}/{repo}.git"


@pytest.fixture(scope="module")
def served(origins, interception, tmp_path_factory):  # noqa: F811
    git = Git(origins, interception, tmp_path_factory.mktemp("git"))
    yield git
    git.close()


def test_a_listed_repository_is_cloned_and_the_session_pushes_its_own_branches(served):
    served.run("clone", "-q", served.url("acme/widget"), str(served.work))
    assert (served.work / "README").read_text() == "widget\n"
    first = served.commit("one")
    done = served.push("HEAD:refs/heads/corral/s1/work")
    assert done.returncode == 0, done.stderr
    assert served.refs()["refs/heads/corral/s1/work"] == first
    second = served.commit("two")  # a fast-forward of the session's own branch
    done = served.push("HEAD:refs/heads/corral/s1/work")
    assert done.returncode == 0, done.stderr
    assert served.refs()["refs/heads/corral/s1/work"] == second
    served.run("fetch", "origin", cwd=served.work)  # raises if it fails


@pytest.mark.parametrize("case", ["main", "force", "delete", "tag", "another session"])
def test_every_other_push_is_refused_with_its_reason_and_changes_nothing(served, case):
    if not served.work.exists():
        test_a_listed_repository_is_cloned_and_the_session_pushes_its_own_branches(served)
    before = served.refs()
    seen = {e["id"] for e in served.filter.events()}
    if case == "main":
        served.commit("to main")
        done, why = served.push("HEAD:main"), "this session may push only refs/heads/corral/s1/**"
    elif case == "force":
        tip = before["refs/heads/corral/s1/work"]
        served.run("reset", "-q", "--hard", f"{tip}~1", cwd=served.work)
        served.commit("rewritten")  # a sibling of the branch's tip: history rewritten
        done = served.push("--force", "HEAD:refs/heads/corral/s1/work")
        why = "a push may only move a ref forward"
    elif case == "delete":
        done, why = served.push(":refs/heads/corral/s1/work"), "a push may never delete a ref"
    elif case == "tag":
        served.run("tag", "-f", "v1", cwd=served.work)
        done, why = served.push("refs/tags/v1"), "this session may push only"
    else:
        done, why = served.push("HEAD:refs/heads/corral/s2/work"), "may push only"
    print(done.stderr)
    assert done.returncode != 0
    assert "[remote rejected]" in done.stderr and why in done.stderr, done.stderr
    assert served.refs() == before
    event = served.filter.wait_event(lambda e: e["id"] not in seen and e["verdict"] == "deny")
    assert event["kind"] == "git" and why in event["reason"]


def test_a_repository_not_listed_is_refused_with_the_reason(served, tmp_path):
    done = served.run("clone", "-q", served.url("other/secret"), str(tmp_path / "secret"),
                      check=False)
    print(done.stderr)
    assert done.returncode != 0
    assert "not listed" in done.stderr and "acme/widget" in done.stderr, done.stderr
    assert not any("other/secret" in line for line in served.server.requests)


def test_git_paths_outside_the_smart_protocol_name_listed_repositories_and_only_read(served):
    port = served.server.port
    with tls_through(served.filter, served.context, "git.test", port) as tls:
        status, headers, _ = get(tls, f"git.test:{port}", "/other/secret.git/HEAD")
        assert status == 403 and "not listed" in headers["x-corral-deny"]
        status, _, body = get(tls, f"git.test:{port}", "/acme/widget.git/HEAD")
        assert status == 200 and body.startswith(b"ref: refs/heads/")  # dumb reads pass
        for method, path in (("PUT", "/acme/widget.git/refs/heads/main"),
                             ("PUT", "/acme/widget.git/info/refs"),
                             ("DELETE", "/acme/widget/git-upload-pack"),
                             ("POST", "/acme/widget.git/objects/x?/info/lfs/objects/batch"),
                             ("POST", "/acme/widget/info/refs?service=git-receive-pack")):
            status, headers, _ = get(tls, f"git.test:{port}", path, method, body=b"x")
            assert status == 403 and "refuses other writes" in headers["x-corral-deny"], path
        # a bare repository's files without `.git` (git http-push), listed or not
        for method, path in (("PUT", "/acme/widget/refs/heads/main"),
                             ("DELETE", "/acme/widget/refs/heads/main"),
                             ("PUT", "/other/secret/packed-refs")):
            status, headers, _ = get(tls, f"git.test:{port}", path, method, body=b"x")
            assert status == 403 and "written only by git push" in headers["x-corral-deny"]
        # WebDAV anywhere on the host: MOVE writes where its Destination header says
        for method, path in (("MOVE", "/acme/widget/tmp"), ("LOCK", "/acme/widget/x"),
                             ("PROPFIND", "/")):
            status, headers, _ = get(tls, f"git.test:{port}", path, method, body=b"x",
                                     extra="Destination: https://git.test/acme/widget/refs/"
                                           "heads/main\r\n")
            assert status == 403 and "WebDAV" in headers["x-corral-deny"], method
        status, headers, _ = get(tls, f"git.test:{port}", "/acme/widget.git%2Fgit-receive-pack",
                                 "POST", body=b"0000")
        assert status == 403 and "encoded slash" in headers["x-corral-deny"]
    assert not any("secret" in line or "%2F" in line for line in served.server.requests)


def test_a_push_is_read_for_leaks_in_its_target_and_refused_at_once_by_its_headers(served):
    port = served.server.port
    token = "ghp_" + "Ab1" * 12
    before = len(served.server.requests)
    with tls_through(served.filter, served.context, "git.test", port) as tls:
        status, headers, _ = get(tls, f"git.test:{port}",
                                 f"/acme/widget.git/git-receive-pack?t={token}", "POST",
                                 body=b"0000", extra="Content-Type: application/"
                                 "x-git-receive-pack-request\r\n")
        assert status == 403 and "GitHub token" in headers["x-corral-deny"]
        # a placeholder in a header refuses the push before its body is read: the answer
        # comes at once, and the connection goes on with the next request
        status, headers, _ = get(tls, f"git.test:{port}", "/acme/widget.git/git-receive-pack",
                                 "POST", extra="X-Note: corral-secret-x-" + "0" * 32 + "\r\n",
                                 body=b"0000")
        assert status == 403 and "placeholder" in headers["x-corral-deny"]
        status, _, _ = get(tls, f"git.test:{port}", "/acme/widget.git/HEAD")
        assert status == 200
    assert served.server.requests[before:] == ["GET /acme/widget.git/HEAD"]


# -- push options: what a forge acts on beyond the refs ------------------------------------

ZERO = "0" * 40
MERGE = ("merge_request.create", "merge_request.target=main")
"""What would have GitLab open a merge request of the session's branch into main."""


@pytest.fixture
def heard(served):
    """acme/widget advertises push options, as GitLab's repositories do, and its
    pre-receive hook writes down those it is handed: the log, emptied."""
    if not served.work.exists():
        test_a_listed_repository_is_cloned_and_the_session_pushes_its_own_branches(served)
    yield fakes.hear_push_options(served.root / "acme/widget.git")
    fakes.forget_push_options(served.root / "acme/widget.git")


def options_are_refused_unheard(world: GitClient, log: Path) -> None:
    """`git push -o ...` to the session's own branch: refused in git's report, naming the
    first option, an event saying so; the server's refs untouched, its hook never run."""
    world.commit("with options")
    before, seen = world.refs(), {e["id"] for e in world.filter.events()}
    done = world.push(*[a for o in MERGE for a in ("-o", o)], "HEAD:refs/heads/corral/s1/opt")
    assert done.returncode != 0
    assert "[remote rejected]" in done.stderr, done.stderr
    assert "push option 'merge_request.create' (and 1 more)" in done.stderr, done.stderr
    assert world.refs() == before and log.read_text() == ""
    event = world.filter.wait_event(lambda e: e["id"] not in seen and e["verdict"] == "deny")
    assert event["kind"] == "git" and "push option 'merge_request.create'" in event["reason"]
    assert "push_options of the [[git]] table for git.test" in event["hint"]


def named_options_reach_the_hook(world: GitClient, log: Path, policy: str, table: str) -> None:
    """With `push_options = ["ci.skip"]` in the table (after its line `table`), `git push
    -o ci.skip` goes through and the server's hook is handed it; an option not named still
    refuses the push."""
    assert table in policy
    world.filter.reload(policy.replace(table, table + 'push_options = ["ci.skip"]\n'))
    try:
        world.commit("skip ci")
        done = world.push("-o", "ci.skip", "HEAD:refs/heads/corral/s1/skip")
        assert done.returncode == 0, done.stderr
        assert fakes.options_heard(log) == ["ci.skip"]
        world.commit("and merge")
        before = world.refs()
        done = world.push("-o", "ci.skip", "-o", "merge_request.create",
                          "HEAD:refs/heads/corral/s1/skip")
        assert done.returncode != 0 and "push option 'merge_request.create'" in done.stderr
        assert world.refs() == before and fakes.options_heard(log) == ["ci.skip"]
    finally:
        world.filter.reload(policy)


def handmade_push(world: GitClient, clone: Path, ref: str, listings: list[bytes],
                  options: tuple[str, ...] = MERGE) -> bytes:
    """A push creating `ref`-N per listing (each a command line's capabilities after NUL),
    with `options` (merge-request ones) after the commands and a real pack of one new
    commit on main (made in `clone`, a clone of the server's repository)."""
    main = world.refs()["refs/heads/main"]
    tree = world.run("rev-parse", f"{main}^{{tree}}", cwd=clone).stdout.strip()
    new = world.run("commit-tree", tree, "-p", main, "-m", f"handmade {ref}",
                    cwd=clone).stdout.strip()
    pack = subprocess.run(["git", "pack-objects", "--revs", "--stdout", "-q"], cwd=clone,
                          env=world.env, input=f"{new}\n^{main}\n".encode(),
                          capture_output=True, check=True).stdout
    lines = b"".join(git.pkt(f"{ZERO} {new} {ref}-{i}".encode() + b"\0" + listing + b"\n")
                     for i, listing in enumerate(listings))
    block = b"".join(git.pkt(o.encode()) for o in options) + git.FLUSH if options else b""
    return lines + git.FLUSH + block + pack


LATER = {"later-line": [b"report-status side-band-64k", b"push-options"],
         "with-value": [b"report-status side-band-64k push-options=1"]}
"""Push options asked for as git's receive-pack reads them, not as `git push` writes them."""


def test_push_options_are_refused_and_never_reach_the_servers_hook(served, heard):
    options_are_refused_unheard(served, heard)


@pytest.mark.parametrize("form", LATER)
def test_push_options_asked_for_on_a_later_line_or_with_a_value_are_refused(served, heard,
                                                                            form):
    port, before = served.server.port, served.refs()
    body = handmade_push(served, served.work, f"refs/heads/corral/s1/{form}", LATER[form])
    requests = len(served.server.requests)
    with tls_through(served.filter, served.context, "git.test", port) as tls:
        status, _, answer = get(tls, f"git.test:{port}", "/acme/widget.git/git-receive-pack",
                                "POST", body=body, extra="Content-Type: application/"
                                "x-git-receive-pack-request\r\n")
    assert status == 200
    assert (f"ng refs/heads/corral/s1/{form}-0 corral: push option 'merge_request.create'"
            .encode()) in answer, answer
    assert served.server.requests[requests:] == [] and served.refs() == before
    assert heard.read_text() == ""


def test_push_options_the_table_names_reach_the_servers_hook(served, heard):
    named_options_reach_the_hook(served, heard, POLICY, 'repos = ["acme/widget"]\n')


# -- a push's body as a server's method override reads it -----------------------------------

FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
              "application/json", "")


@pytest.mark.parametrize("content_type", FORM_TYPES)
def test_a_push_typed_as_a_body_a_server_reads_for_overrides_is_refused_unsent(
        served, content_type):
    """A push is read for its refs, never for `_method`: typed as a form (or multipart,
    JSON, or nothing, which Rack reads as a form), a push carrying `&_method=DELETE&` in a
    command line's capabilities went to the origin on a host whose request rules deny
    DELETE. git types its pushes (and git-http-backend refuses any other type), so such a
    push is refused before its body is read."""
    if not served.work.exists():
        test_a_listed_repository_is_cloned_and_the_session_pushes_its_own_branches(served)
    port, before = served.server.port, served.refs()
    table = 'repos = ["acme/widget"]\n'
    served.filter.reload(POLICY + '\n[[inspect]]\nhost = "git.test"\ndeny = ["DELETE /**"]\n')
    try:
        ref = f"refs/heads/corral/s1/typed{len(content_type)}"
        body = handmade_push(served, served.work, ref, [b"report-status &_method=DELETE& x"],
                             options=())
        assert table in POLICY
        requests = len(served.server.requests)
        typed = f"Content-Type: {content_type}\r\n" if content_type else ""
        with tls_through(served.filter, served.context, "git.test", port) as tls:
            status, headers, answer = get(tls, f"git.test:{port}",
                                          "/acme/widget.git/git-receive-pack", "POST",
                                          body=body, extra=typed)
        assert status == 403, (status, answer, served.server.requests[requests:])
        assert "Content-Type" in headers["x-corral-deny"]
        assert served.server.requests[requests:] == [] and served.refs() == before
    finally:
        served.filter.reload(POLICY)
