"""The README's quick start, run as written: every command in its `sh` blocks, in order, by
a shell, against the local backend of the e2e tier, so that the quick start cannot go stale.

Claude Code itself would need Anthropic's API, so the project holds a team profile named
`claude` (in its .corral/agents/, where it shadows the shipped one) that is the shipped
profile with only its install replaced by the stand-in agent (test_agents.py), told by its
environment to do what an agent at work does: call its API with the key's placeholder, ask
for a host no rule names, and write a file. The appliance's name is the README's (none: the
CLI's `default`), the key is in the environment as `printenv` expects, and `~` is a home
made here. The words a person fills in (ID, DIGEST) are taken from what the commands before
printed, as a person would take them. A command this test does not know how to run fails
it: a new step in the quick start gets a test here first.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

from . import netns, test_agents
from .conftest import APPLIANCE_NAME, BIN, ROOT
from .test_agents import SECRETS, profile_for

standin = test_agents.standin
"""The stand-in's wheel on the fake index and the keys held by the appliance (a fixture)."""

ASKED_FOR = "allowed.test"
"""A host the stand-in asks for: no rule of the session names it (the fake internet serves
it), so in ask mode it waits for a person."""
WRITTEN = "STANDIN.md"


def quick_start() -> list[str]:
    """The commands of the README's quick start, in order: each line of its sh blocks."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```sh\n(.*?)^```", section, re.M | re.S)
    assert blocks, "the README's quick start has no sh block"
    return [line.strip() for block in blocks for line in block.splitlines()
            if line.strip() and not line.strip().startswith("#")]


class Person:
    """A person at a shell in the appliance namespace, with a home of their own."""

    def __init__(self, world, home: Path):
        self.world, self.home, self.cwd = world, home, home
        config = home / ".config" / "corral" / "appliances"
        config.mkdir(parents=True, exist_ok=True)
        default = config / "default"
        if not default.exists():  # the README names no appliance: this one is the default
            default.symlink_to(world.dir / "config" / "corral" / "appliances" / APPLIANCE_NAME)
        self.env = {**os.environ, "HOME": str(home), "PATH": f"{BIN}:{os.environ['PATH']}",
                    "ANTHROPIC_API_KEY": SECRETS["ANTHROPIC_API_KEY"]}
        self.env.pop("XDG_CONFIG_HOME", None)

    def _argv(self, line: str) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{netns.APPLIANCE}", "bash", "-c", line]

    def run(self, line: str, timeout: float = 600) -> subprocess.CompletedProcess:
        done = subprocess.run(self._argv(line), cwd=self.cwd, env=self.env, text=True,
                              capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, f"{line}: exit {done.returncode}\n{done.stdout}{done.stderr}"
        return done

    def start(self, line: str) -> subprocess.Popen:
        return subprocess.Popen(self._argv(line), cwd=self.cwd, env=self.env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def read_until(process: subprocess.Popen, wanted, timeout: float) -> str:
    """What `process` printed up to the first line `wanted` accepts."""
    seen, deadline = "", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 1)
        if ready:
            line = process.stdout.readline()
            if not line and process.poll() is not None:
                break
            seen += line
            if wanted(line):
                return seen
    raise AssertionError(f"not seen within {timeout}s; saw:\n{seen}")


@pytest.fixture
def project(world, standin):
    home = world.dir / "quickstart-home"
    path = home / "src" / "myproject"
    (path / ".corral" / "agents").mkdir(parents=True)
    profile, count = re.subn(  # the shipped environment, and what the stand-in is to do
        r"^environment = \{ (.*) \}$",
        rf'environment = {{ \1, STANDIN_ASK = "{ASKED_FOR}", STANDIN_WRITE = "{WRITTEN}" }}',
        profile_for("claude"), flags=re.M)
    assert count == 1, profile
    (path / ".corral" / "agents" / "claude.toml").write_text(profile)
    (path / "README.md").write_text("my project\n")
    yield home, path
    subprocess.run(["nsenter", f"--net=/run/netns/{netns.APPLIANCE}", str(BIN / "corral"),
                    "rm", "demo", "--home", "--appliance", APPLIANCE_NAME],
                   env=world.cli_env, capture_output=True, timeout=120)


def test_the_readmes_quick_start_runs_as_written(world, project):
    home, path = project
    person = Person(world, home)
    commands = quick_start()
    started = time.monotonic()
    agent = monitor = None
    filled: dict[str, str] = {}
    first_allowed = None
    try:
        for line in commands:
            for word, value in filled.items():
                line = re.sub(rf"\b{word}\b", value, line)
            if line.startswith("cd "):
                person.cwd = Path(line[3:].replace("~", str(home)))
                assert person.cwd == path
            elif re.match(r"printenv ANTHROPIC_API_KEY \| corral secret set ", line):
                person.run(line)
            elif line.startswith("corral run --agent claude"):
                agent = person.start(line)  # it attaches; the agent runs until it is done
            elif line.startswith("corral monitor"):
                monitor = person.start(line)
                read_until(monitor, lambda x: "api.anthropic.com" in x and "allow" in x, 180)
                first_allowed = time.monotonic() - started
                os.killpg(monitor.pid, signal.SIGINT)  # Ctrl-C leaves it
                monitor.wait(30)
            elif line.startswith("corral approvals"):
                deadline = time.monotonic() + 120
                while True:
                    listed = person.run(line).stdout
                    rows = [r.split() for r in listed.splitlines()[1:] if ASKED_FOR in r]
                    if rows or time.monotonic() > deadline:
                        break
                    time.sleep(1)
                assert rows, listed
                filled["ID"] = rows[0][0]
            elif line.startswith("corral approve "):
                assert "ID" not in line, "the approve line came before approvals"
                person.run(line)
                ran = read_until(agent, lambda x: x.startswith("STANDIN "), 180)
                assert agent.wait(120) == 0, ran
                said = ran.splitlines()[-1]
                assert '"asked": 200' in said, said  # the approved request went through
                assert SECRETS["ANTHROPIC_API_KEY"] in said  # the API got the key
            elif line.startswith("corral diff "):
                shown = person.run(line).stdout
                assert f"+++ b/{WRITTEN}" in shown, shown
                filled["DIGEST"] = re.search(r"^digest (\S+)$", shown, re.M).group(1)
            elif line.startswith("corral apply "):
                assert "DIGEST" not in line, "the apply line came before diff"
                person.run(line)
                assert (path / WRITTEN).read_text() == "written by the stand-in agent\n"
            else:
                pytest.fail(f"the quick start has a command this test does not run: {line}")
    finally:
        for process in (agent, monitor):
            if process is None:
                continue
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            process.stdout.close()
    assert first_allowed is not None
    print(f"quick start: the agent's first allowed request {first_allowed:.1f}s after the "
          f"first command; all of it {time.monotonic() - started:.1f}s")
