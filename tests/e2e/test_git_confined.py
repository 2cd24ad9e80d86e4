"""git confined to the session, as an agent meets it: a real session (`corral run` on the
local backend) whose project lists one repository of the fake internet's git server
(`git http-backend` behind TLS) in a [[git]] table. The image's own git clones, fetches and
pushes onto a branch of the session's own; a push to main, a force-push, a delete, a tag
and a push onto another session's branch are each refused with the reason `git push`
prints, and the server's refs stay as they were; a repository not listed cannot be cloned.

The same over SSH (`git@git.test:acme/widget.git`): the fake internet's SSH server runs
git-shell for one key, which `corral secret set --ssh` gives the appliance; the session's
ssh reaches it only through the filter's git gateway, with a key of its own.

The server's repositories advertise push options, as GitLab's do, and a hook writes down
the options a push hands it: a push onto the session's own branch with `git push -o
merge_request.create -o merge_request.target=main` is refused over HTTPS and SSH, and the
hook never runs."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.fakes import PUSH_OPTIONS_LOG, GitHttp

from .conftest import APPLIANCE_NAME
from .internet import GIT_PORT, GIT_SSH_PORT, WEB
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
    stored = world.corral("secret", "set", "GIT_DEPLOY_KEY", "--appliance", APPLIANCE_NAME,
                          "--ssh", "--host", "git.test", "--port", str(GIT_SSH_PORT),
                          "--known-hosts", str(world.dir / "git-ssh-host.pub"),
                          input=(world.dir / "git-ssh-held-key").read_text())
    assert stored.returncode == 0, stored.stdout + stored.stderr
    assert "PRIVATE KEY" not in stored.stdout + stored.stderr
    corral(world, "run", "--project", str(project), "--name", SESSION, "--detach")
    yield world.dir / "git"
    corral(world, "rm", SESSION, check=False)
    world.corral("secret", "rm", "GIT_DEPLOY_KEY", "--appliance", APPLIANCE_NAME)


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
    # the server's hook ran for these pushes, handed no option
    assert "push 0" in (confined / "acme/widget.git" / PUSH_OPTIONS_LOG).read_text()


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


@pytest.mark.parametrize("url", [f"{URL}/acme/widget.git", "git@git.test:acme/widget.git"],
                         ids=["https", "ssh"])
def test_a_push_with_options_onto_the_sessions_own_branch_is_refused_unheard(world, confined,
                                                                           url):
    log = confined / "acme/widget.git" / PUSH_OPTIONS_LOG
    before, heard = GitHttp.refs(confined / "acme/widget.git"), log.read_text()
    done = inside(world, f"rm -rf o && git clone -q {url} o && cd o && "
                  "git commit -qm options --allow-empty && git push -o merge_request.create "
                  "-o merge_request.target=main origin HEAD:refs/heads/corral/g1/options")
    assert done.returncode != 0, done.stdout + done.stderr
    assert "[remote rejected]" in done.stderr, done.stderr
    assert "push option 'merge_request.create' (and 1 more)" in done.stderr, done.stderr
    assert GitHttp.refs(confined / "acme/widget.git") == before
    assert log.read_text() == heard  # the server's hook never ran


def test_a_repository_not_listed_is_not_cloned(world, confined):
    done = inside(world, f"git clone -q {URL}/other/secret.git s")
    assert done.returncode != 0
    assert "not listed" in done.stderr and "acme/widget" in done.stderr, done.stderr


SSH_URL = "git@git.test:acme/widget.git"


def test_over_ssh_the_session_clones_and_pushes_its_own_branch_through_the_gateway(world,
                                                                                 confined):
    # a line of the held key's own (the first lines are the format's, the same in any key)
    held = (world.dir / "git-ssh-held-key").read_text().splitlines()[3]
    done = inside(world, f"git clone -q {SSH_URL} s && cd s && echo ssh > notes && "
                  "git add notes && git commit -qm ssh && "
                  "git push -q origin HEAD:refs/heads/corral/g1/ssh && git fetch -q && "
                  f"! grep -rqs '{held}' /etc /home /tmp /work && git rev-parse HEAD")
    assert done.returncode == 0, done.stdout + done.stderr
    head = done.stdout.strip().splitlines()[-1]
    assert GitHttp.refs(confined / "acme/widget.git")["refs/heads/corral/g1/ssh"] == head


@pytest.mark.parametrize(("push", "why"), [
    ("git commit -qm main --allow-empty && git push origin HEAD:main",
     "this session may push only refs/heads/corral/g1/**"),
    ("git reset -q --hard HEAD~1 && git commit -qm rewritten --allow-empty && "
     "git push --force origin HEAD:refs/heads/corral/g1/ssh", "only move a ref forward"),
], ids=["main", "force"])
def test_over_ssh_every_other_push_is_refused_with_the_reason_git_prints(world, confined,
                                                                         push, why):
    before = GitHttp.refs(confined / "acme/widget.git")
    done = inside(world, f"rm -rf q && git clone -q {SSH_URL} q && cd q && "
                  "git fetch -q origin refs/heads/corral/g1/ssh && "
                  f"git reset -q --hard FETCH_HEAD && {push}")
    assert done.returncode != 0, done.stdout + done.stderr
    assert "[remote rejected]" in done.stderr and why in done.stderr, done.stderr
    assert GitHttp.refs(confined / "acme/widget.git") == before


def test_over_ssh_nothing_but_the_gateway_reaches_the_host(world, confined):
    """The git server's own SSH port is closed to the session (no tcp rule), and so is a
    repository the [[git]] table does not list, through the gateway."""
    done = inside(world, f"ssh -o BatchMode=yes -o StrictHostKeyChecking=no -o "
                  f"ConnectTimeout=5 -p {GIT_SSH_PORT} git@{WEB} git-upload-pack "
                  "acme/widget.git")
    assert done.returncode == 255, done.stdout + done.stderr
    done = inside(world, "git ls-remote git@git.test:other/secret.git")
    assert done.returncode != 0 and "not listed" in done.stderr, done.stderr


def test_the_batterys_pushes_over_ssh_are_refused_and_recorded(world, confined):
    """`corral selftest --git-ssh`: the probes push onto main, and onto the session's own
    branch with push options asked for as receive-pack reads them, through the gateway;
    the appliance finds each refusal in what the filter recorded, and the host's refs and
    its hook hold."""
    before = GitHttp.refs(confined / "acme/widget.git")
    log = confined / "acme/widget.git" / PUSH_OPTIONS_LOG
    heard = log.read_text()
    probes = ["ssh-push-refused", "ssh-push-options-refused"]
    result = corral(world, "selftest", SESSION, "--allowed", "git.test", "--git-ssh",
                    "git.test", "--git-repo", "acme/widget",
                    *[a for p in probes for a in ("--only", p)], "--json", check=False,
                    timeout=300)
    answer = json.loads(result.stdout)
    assert result.returncode == 0 and answer["passed"], json.dumps(answer["probes"])
    assert [p["id"] for p in answer["probes"]] == probes
    assert answer["tally"]["unrecorded"] == 0
    assert GitHttp.refs(confined / "acme/widget.git") == before
    assert log.read_text() == heard
