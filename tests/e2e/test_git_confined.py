"""git confined to the session, as an agent meets it: a real session (`corral run` on the
local backend) whose project lists one repository of the fake internet's git server
(`git http-backend` behind TLS) in a [[git]] table. The image's own git clones, fetches and
pushes onto a branch of the session's own; a push to main, a force-push, a delete, a tag
and a push onto another session's branch are each refused with the reason `git push`
prints, and the server's refs stay as they were; a repository not listed cannot be cloned."""

from __future__ import annotations

import subprocess

import pytest

from tests.fakes import GitHttp

from .internet import GIT_PORT
from .test_cli_sessions import corral

SESSION = "g1"
POLICY = f"""
[http]
allow = ["git.test:{GIT_PORT}"]

[[git]]
host = "git.test"
repos = ["acme/widget"]
"""
URL = f"https://git.test:{GIT_PORT}"
SETUP = ("git config --global user.email agent@corral.test && "
         "git config --global user.name agent && cd /tmp")


@pytest.fixture(scope="module")
def confined(world, sandbox_image):
    project = world.dir / "git-project"
    project.mkdir(exist_ok=True)
    (project / "corral.toml").write_text(POLICY)
    corral(world, "run", "--project", str(project), "--name", SESSION, "--detach")
    yield world.dir / "git"
    corral(world, "rm", SESSION, check=False)


def inside(world, script: str) -> subprocess.CompletedProcess:
    return corral(world, "shell", SESSION, "--", "sh", "-c", f"{SETUP} && {script}",
                  check=False, timeout=180)


def test_the_session_clones_fetches_and_pushes_its_own_branch(world, confined):
    done = inside(world, f"git clone -q {URL}/acme/widget.git w && cd w && "
                  "echo one > notes && git add notes && git commit -qm one && "
                  "git push -q origin HEAD:refs/heads/corral/g1/work && "
                  "echo two > notes && git commit -qam two && "
                  "git push -q origin HEAD:refs/heads/corral/g1/work && git fetch -q && "
                  "git rev-parse HEAD")
    assert done.returncode == 0, done.stdout + done.stderr
    head = done.stdout.strip().splitlines()[-1]
    assert GitHttp.refs(confined / "acme/widget.git")["refs/heads/corral/g1/work"] == head


@pytest.mark.parametrize(("push", "why"), [
    ("git commit -qm main --allow-empty && git push origin HEAD:main",
     "this session may push only refs/heads/corral/g1/**"),
    ("git reset -q --hard HEAD~1 && git commit -qm rewritten --allow-empty && "
     "git push --force origin HEAD:refs/heads/corral/g1/work", "only move a ref forward"),
    ("git push origin :refs/heads/corral/g1/work", "never delete a ref"),
    ("git tag v1 && git push origin refs/tags/v1", "this session may push only"),
    ("git push origin HEAD:refs/heads/corral/other/work", "this session may push only"),
], ids=["main", "force", "delete", "tag", "another-session"])
def test_every_other_push_is_refused_with_the_reason_git_prints(world, confined, push, why):
    before = GitHttp.refs(confined / "acme/widget.git")
    done = inside(world, f"rm -rf p && git clone -q {URL}/acme/widget.git p && cd p && "
                  f"git fetch -q origin refs/heads/corral/g1/work && "
                  f"git reset -q --hard FETCH_HEAD && {push}")
    assert done.returncode != 0, done.stdout + done.stderr
    assert "[remote rejected]" in done.stderr and why in done.stderr, done.stderr
    assert GitHttp.refs(confined / "acme/widget.git") == before


def test_a_repository_not_listed_is_not_cloned(world, confined):
    done = inside(world, f"git clone -q {URL}/other/secret.git s")
    assert done.returncode != 0
    assert "not listed" in done.stderr and "acme/widget" in done.stderr, done.stderr
