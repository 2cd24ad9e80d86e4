"""corral-filter refuses to start half-configured: exit 2 names file, key (and line)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXE = str(Path(sys.executable).parent / "corral-filter")


def run(config: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, "--config", str(config), *args], capture_output=True, text=True,
                          timeout=30)


def write(tmp_path: Path, text: str, policy: str | None = None) -> Path:
    if policy is not None:
        (tmp_path / "corral.toml").write_text(policy)
    config = tmp_path / "filter.toml"
    config.write_text(f"""
[dns]
listen = ["127.0.0.1:0"]
upstream = ["127.0.0.1:9"]
[state]
dir = "{tmp_path}/state"
[control]
socket = "{tmp_path}/filter.sock"
{text}
""")
    return config


@pytest.mark.parametrize(("extra", "message"), [
    ("[proxy]\nlisten = [\"localhost:3128\"]", "[proxy] listen: 'localhost:3128': listen and"
     " upstream addresses must be IP addresses"),
    ("[proxy]\nlistne = []", "[proxy] listne: unknown key"),
    ("[prxy]\nlisten = []", "prxy: unknown key"),
    ("[proxy]\nheader_timeout = -1", "[proxy] header_timeout: must be greater than 0"),
    ("[[session]]\nname = \"Bad Name\"\nsubnet = \"10.0.0.0/24\"", "[session] name:"),
    ("[[session]]\nname = \"a\"\nsubnet = \"10.0.0.0/24\"\n[[session]]\nname = \"b\"\n"
     "subnet = \"10.0.0.128/25\"", "overlaps session a"),
    ("[host]\ngateway = \"nope\"", "[host] gateway: 'nope' is not an IPv4 address"),
    ("[dns\n", "not valid TOML"),
    ("group = \"no-such-group-xyz\"", "[control] group: no group 'no-such-group-xyz'"),
])
def test_invalid_config_exits_2_naming_key(tmp_path, extra, message):
    result = run(write(tmp_path, extra))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert str(tmp_path / "filter.toml") in result.stderr
    assert not (tmp_path / "filter.sock").exists()


def test_bad_policy_file_exits_2_with_line(tmp_path):
    policy = '[http]\nallow = [\n  "good.example",\n  "bad name.example",\n]\n'
    config = write(tmp_path, f'[policy]\nfiles = ["{tmp_path}/corral.toml"]', policy)
    result = run(config)
    assert result.returncode == 2
    assert f"{tmp_path}/corral.toml:4: [http] allow: 'bad name.example' is not a valid host" in (
        result.stderr)


def test_unknown_preset_and_unknown_policy_key(tmp_path):
    config = write(tmp_path, f'[policy]\nfiles = ["{tmp_path}/corral.toml"]',
                   'presets = ["pypi", "nosuch"]\n')
    result = run(config)
    assert result.returncode == 2 and "unknown preset 'nosuch'" in result.stderr
    (tmp_path / "corral.toml").write_text('[htttp]\nallow = ["x.example"]\n')
    result = run(config)
    assert result.returncode == 2 and "corral.toml:1: htttp: unknown key" in result.stderr


def test_check_mode_validates_without_serving(tmp_path):
    config = write(tmp_path, f'[policy]\nfiles = ["{tmp_path}/corral.toml"]',
                   'presets = ["pypi"]\n')
    result = run(config, "--check")
    assert result.returncode == 0 and "ok; 4 appliance rules, 0 sessions" in result.stdout


def test_port_in_use_exits_1_naming_the_address(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run(write(tmp_path, f'[proxy]\nlisten = ["127.0.0.1:{port}"]'))
    assert result.returncode == 1
    assert f"cannot bind 127.0.0.1:{port} (tcp): Address already in use" in result.stderr
    assert not (tmp_path / "filter.sock").exists()


def test_corrupt_runtime_state_refuses_to_start(tmp_path):
    config = write(tmp_path, '[[session]]\nname = "s1"\nsubnet = "10.9.0.0/24"')
    (tmp_path / "state" / "runtime").mkdir(parents=True)
    (tmp_path / "state" / "runtime" / "s1.json").write_text('{"rules": [{"kind": "http"}]}')
    result = run(config)
    assert result.returncode == 2 and "s1.json: rules[0]: needs kind and rule" in result.stderr
