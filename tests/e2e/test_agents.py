"""`corral run --agent NAME PROJECT` as a person runs it, for each shipped profile, on the
local backend: the agent installed once per appliance through the filter (from a package
index of the fake internet), then run in the session with its secrets held by the appliance,
its install read-only, its policy as a layer of its own and its home's directories made.

The agents themselves would need their vendors' APIs, so a stand-in takes their place: one
wheel, built here, whose console scripts carry the four agents' names. Each reads the
secret variables its profile names and calls the profile's API hosts with them in the
profile's form, and prints what the host received. Each test profile is the shipped one with
only [install] replaced (the stand-in, from https://pypi.test:PORT/simple/), placed in the
project's .corral/agents/ where it shadows the shipped one.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import re
import time
import zipfile

import pytest

from appliance.agents.profile import MOUNT, parse_profile, shipped
from appliance.policy.layers import policy_file_rules

from .conftest import APPLIANCE_NAME
from .internet import PYPI_PORT
from .test_cli_sessions import corral

AGENTS = sorted(p.stem for p in shipped().glob("*.toml"))
INDEX = f"https://pypi.test:{PYPI_PORT}/simple/"
STANDIN = "corral-standin"
SECRETS = {"ANTHROPIC_API_KEY": "sk-ant-e2e-0123456789abcdefVALUE",
           "OPENAI_API_KEY": "sk-openai-e2e-0123456789abcdefVALUE"}
STANDIN_CODE = '''\
import json, os, sys, urllib.request

CALLS = {calls}


def main():
    command = os.path.basename(sys.argv[0])
    seen = {{"command": command, "argv": sys.argv[1:], "prefix": sys.prefix, "calls": []}}
    for variable, host, header in CALLS[command]:
        value = os.environ.get(variable, "")
        request = urllib.request.Request(f"https://{{host}}/standin/{{command}}")
        request.add_header(header or "Authorization", value if header else f"Bearer {{value}}")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                origin = json.loads(response.read())
            seen["calls"].append({{"variable": variable, "host": host, "header": header,
                                  "received": origin["headers"]}})
        except Exception as exc:
            seen["calls"].append({{"variable": variable, "host": host, "error": repr(exc)}})
    ask = os.environ.get("STANDIN_ASK")
    if ask:  # a host no rule names: in ask mode it waits for a person's decision
        try:
            with urllib.request.urlopen(f"https://{{ask}}/standin", timeout=120) as response:
                seen["asked"] = response.status
        except Exception as exc:
            seen["asked"] = repr(exc)
    write = os.environ.get("STANDIN_WRITE")
    if write:  # its work, in /work, for `corral diff` and `corral apply`
        with open(write, "w") as out:
            out.write("written by the stand-in agent\\n")
    print("STANDIN " + json.dumps(seen), flush=True)
'''


def profiles() -> dict:
    return {name: parse_profile((shipped() / f"{name}.toml").read_text(), f"{name}.toml")
            for name in AGENTS}


def standin_wheel() -> tuple[str, bytes]:
    """A wheel of the stand-in, by hand (a wheel is a zip with a dist-info): one console
    script per shipped profile, each calling the hosts that profile's secrets go to."""
    calls = {name: [[s.name, s.hosts[0], s.header] for s in profile.secrets]
             for name, profile in profiles().items()}
    dist = "corral_standin-1.0.dist-info"
    files = {
        "corral_standin/__init__.py": STANDIN_CODE.format(calls=json.dumps(calls)).encode(),
        f"{dist}/METADATA": b"Metadata-Version: 2.1\nName: corral-standin\nVersion: 1.0\n",
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: corral-e2e\nRoot-Is-Purelib: true\n"
                         b"Tag: py3-none-any\n",
        f"{dist}/entry_points.txt": ("[console_scripts]\n" + "".join(
            f"{name} = corral_standin:main\n" for name in AGENTS)).encode(),
    }
    record = "".join(
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
        f"{len(data)}\n" for path, data in files.items()) + f"{dist}/RECORD,,\n"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path, data in [*files.items(), (f"{dist}/RECORD", record.encode())]:
            archive.writestr(path, data)
    return "corral_standin-1.0-py3-none-any.whl", buffer.getvalue()


def profile_for(name: str, spec: str = f"{STANDIN}==1.0") -> str:
    """The shipped profile with only its [install] table replaced."""
    text = (shipped() / f"{name}.toml").read_text()
    replaced, count = re.subn(r"^\[install\]\n(?:[^\[\n].*\n)*",
                              f'[install]\npypi = "{spec}"\nindex = "{INDEX}"\n', text,
                              flags=re.M)
    assert count == 1, text
    parse_profile(replaced, f"{name}.toml")
    return replaced


def downloads(world) -> int:
    path = world.dir / "pypi-requests.log"
    lines = path.read_text().splitlines() if path.exists() else []
    return sum(1 for line in lines if "/files/corral_standin-" in line)


@pytest.fixture(scope="module")
def standin(world, podman, sandbox_image):
    """The wheel on the fake index, the secrets held by the appliance, and the fake
    internet's CA among those the session image trusts (as a real appliance's image trusts
    the public CAs that sign pypi.org: the install's registry is reached through a spliced
    tunnel, its certificate checked by pip itself)."""
    wheel, data = standin_wheel()
    (world.dir / "pypi" / wheel).write_bytes(data)
    for variable, value in SECRETS.items():
        form = ["--header", "x-api-key"] if variable.startswith("ANTHROPIC") else ["--bearer"]
        host = "api.anthropic.com" if variable.startswith("ANTHROPIC") else "api.openai.com"
        stored = world.corral("secret", "set", variable, "--appliance", APPLIANCE_NAME,
                              "--host", host, *form, input=value + "\n")
        assert stored.returncode == 0, stored.stdout + stored.stderr
    image_id = podman.json("image", "inspect", sandbox_image)[0]["Id"]
    kept = world.dir / "sandbox" / "trust" / f"{image_id[:64]}.crt"
    before = kept.read_bytes() if kept.exists() else None
    bundle = before or podman.run("run", "--rm", "--network", "none", "--entrypoint", "cat",
                                  sandbox_image, "/etc/ssl/certs/ca-certificates.crt").stdout
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_bytes(bundle.rstrip(b"\n") + b"\n" + (world.dir / "ca.pem").read_bytes())
    yield
    if before is None:
        kept.unlink()
    else:
        kept.write_bytes(before)
    for variable in SECRETS:
        world.corral("secret", "rm", variable, "--appliance", APPLIANCE_NAME)


def project_for(world, name: str, profile_text: str):
    project = world.dir / f"agent-project-{name}"
    (project / ".corral" / "agents").mkdir(parents=True, exist_ok=True)
    (project / ".corral" / "agents" / f"{name}.toml").write_text(profile_text)
    (project / "README.md").write_text(f"a project for {name}\n")
    return project


def inside(world, session: str, script: str) -> str:
    return corral(world, "shell", session, "--", "sh", "-c", script).stdout


@pytest.mark.parametrize("name", AGENTS)
def test_an_agent_runs_with_its_secrets_held_its_install_read_only_and_its_own_layer(
        world, standin, name):
    profile = parse_profile(profile_for(name), f"{name}.toml")
    project = project_for(world, name, profile.text)
    session = f"agent-{name}"
    fetched = downloads(world)
    # another test's session of this profile may have installed it (the quick start's)
    installed = any((world.dir / "sandbox" / "agents").glob(f"{name}-*.json"))
    started = time.monotonic()
    ran = corral(world, "run", "--agent", name, str(project), "--name", session, "--",
                 "--from-the-test")
    first = time.monotonic() - started
    try:
        # the stand-in ran as the agent's command, with the words after -- added
        line = next(x for x in ran.stdout.splitlines() if x.startswith("STANDIN "))
        seen = json.loads(line.removeprefix("STANDIN "))
        assert seen["command"] == profile.command[0] and seen["prefix"] == f"{MOUNT}/venv"
        assert seen["argv"] == [*profile.command[1:], "--from-the-test"]
        # each API host got the real key in the profile's form; the session never had it
        assert [c["variable"] for c in seen["calls"]] == [s.name for s in profile.secrets]
        for call, secret in zip(seen["calls"], profile.secrets, strict=True):
            assert "error" not in call, call
            got = call["received"].get(secret.header.lower() or "authorization")
            assert got == (SECRETS[secret.name] if secret.header
                           else f"Bearer {SECRETS[secret.name]}"), call
        assert downloads(world) == fetched + (not installed)  # once, through the filter

        env = inside(world, session, "env")
        for secret in profile.secrets:
            assert re.search(rf"^{secret.name}=corral-secret-", env, re.M), env
        assert not any(value in env for value in SECRETS.values())  # (the origin echoed it)
        assert re.search(rf"^PATH={MOUNT}/bin:/", env, re.M), env
        for key, value in profile.environment:
            assert f"\n{key}={value}\n" in f"\n{env}"
        login = inside(world, session, "bash -lc 'command -v " + profile.command[0] + "'")
        assert login.strip() == f"{MOUNT}/bin/{profile.command[0]}"  # a login shell too
        # the install's own python3 and pip stay in its venv: the image's are the session's
        # one name per `command -v`: dash's prints the first of several only
        tools = inside(world, session, "command -v python3; command -v pip; ls "
                       + f"{MOUNT}/bin")
        assert tools.split()[:2] == ["/usr/bin/python3", "/usr/bin/pip"], tools
        assert sorted(tools.split()[2:]) == AGENTS, tools  # the package's commands alone

        wrote = inside(world, session, f"touch {MOUNT}/bin/planted 2>&1; echo $?; "
                       f"touch {MOUNT}/planted 2>&1; echo $?")
        assert wrote.count("Read-only file system") == 2, wrote

        rules = json.loads(corral(world, "rules", "--session", session, "--json").stdout)
        listed = {(r["kind"], r["rule"]): r["source"] for r in rules["rules"]}
        for rule in policy_file_rules(profile.policy, "profile", "project"):
            source = listed[(rule.kind, rule.text)]
            if rule.source.startswith("preset:"):
                assert source == rule.source
            else:  # the profile's own rules name its layer's file
                assert source.endswith(f"/agent-{name}.toml"), source

        checks = "; ".join(f'test -w "$HOME/{p}" && test -d "$HOME/{p}" && echo ok {p}'
                           for p in profile.persist if "." not in p.lstrip("."))
        files = "; ".join(f'echo x > "$HOME/{p}" && echo ok {p}'
                          for p in profile.persist if "." in p.lstrip("."))
        kept = inside(world, session, "; ".join(x for x in (checks, files) if x))
        assert sorted(kept.split()[1::2]) == sorted(profile.persist), kept

        sessions = {s["name"]: s for s in json.loads(
            corral(world, "ls", "--json").stdout)["sessions"]}
        assert sessions[session]["agent"]["name"] == name
        assert sessions[session]["agent"]["version"] == "1.0"
        assert not [s for s in sessions if s.startswith("agent-install-")]  # removed again
        table = corral(world, "ls").stdout.splitlines()
        assert table[0].split()[-1] == "AGENT"
        assert any(line.split()[0] == session and line.split()[-2:] == [name, "1.0"]
                   for line in table[1:]), table

        started = time.monotonic()
        again = corral(world, "run", "--agent", name, str(project), "--name",
                       f"{session}-2", "--detach", "--json")
        print(f"agent {name}: first session (with its install) {first:.1f}s, second "
              f"{time.monotonic() - started:.1f}s")
        assert downloads(world) == fetched + (not installed)  # the second: nothing
        assert json.loads(again.stdout)["agent"] == sessions[session]["agent"]
    finally:
        corral(world, "rm", f"{session}-2", check=False)
        corral(world, "rm", session, "--home", check=False)


def test_a_failed_install_refuses_the_session_with_what_pip_said(world, standin):
    project = project_for(world, "claude", profile_for("claude", "corral-missing==9.9"))
    refused = corral(world, "run", "--agent", "claude", str(project), "--name", "agent-none",
                     "--detach", check=False)
    assert refused.returncode != 0
    assert "installing agent claude (corral-missing==9.9" in refused.stderr, refused.stderr
    assert "No matching distribution found for corral-missing==9.9" in refused.stderr
    names = [s["name"] for s in json.loads(corral(world, "ls", "--json").stdout)["sessions"]]
    assert "agent-none" not in names and not [n for n in names if "install" in n], names
    agents = world.dir / "sandbox" / "agents"
    assert not [p.name for p in agents.iterdir() if p.name.startswith(".")  # no scratch left
                or (p.is_dir() and not (agents / f"{p.name}.json").exists())]
