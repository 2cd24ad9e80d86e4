"""Agent profiles: every shipped one loads, and every mistake a team can make in its own is
named by file, line and key before anything reaches an appliance."""

from __future__ import annotations

import os
import subprocess
import tomllib
import zipfile

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.agents.profile import (
    MOUNT,
    REGISTRIES,
    Install,
    available,
    find,
    parse_profile,
    search_path,
    shipped,
    toml_text,
)
from appliance.policy.config import ConfigError
from appliance.policy.layers import policy_file_rules

SHIPPED = sorted(shipped().glob("*.toml"))

MINIMAL = """\
description = "a stand-in"
[install]
pypi = "corral-standin==1.0"
[run]
command = ["standin"]
"""


def test_corral_ships_the_four_agents_the_issue_names():
    assert {p.stem for p in SHIPPED} >= {"claude", "codex", "aider", "opencode"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_each_shipped_profile_loads_pinned_with_a_policy_the_filter_takes(path):
    profile = parse_profile(path.read_text("utf-8"), str(path))
    assert profile.name == path.stem and profile.description
    assert profile.install.version[0].isdigit()  # one exact version, never a range or tag
    assert profile.install.index == REGISTRIES[profile.install.kind]
    assert profile.command and profile.persist
    rules = policy_file_rules(profile.policy, "profile", "project")
    for secret in profile.secrets:  # its API's host is allowed by its own layer
        assert any(r.kind == "http" and r.text.split(":")[0] in secret.hosts for r in rules), \
            secret.name
        assert secret.set_command().startswith(f"printenv {secret.name} | corral secret set")


def test_the_claude_profile_sends_its_key_as_anthropic_reads_it():
    profile = parse_profile((shipped() / "claude.toml").read_text(), "claude.toml")
    (key,) = profile.secrets
    assert (key.name, key.hosts, key.form) == ("ANTHROPIC_API_KEY", ("api.anthropic.com",),
                                               "header x-api-key")
    assert key.set_command() == ("printenv ANTHROPIC_API_KEY | corral secret set "
                                 "ANTHROPIC_API_KEY --host api.anthropic.com --header x-api-key")
    assert profile.install.command()[-1] == "@anthropic-ai/claude-code@2.1.90"
    assert profile.install.policy_text() == 'presets = ["npm"]\n'


@pytest.mark.parametrize("change, key, line", [
    (("[run]", "[rnu]"), "rnu", 4),
    (('pypi = "corral-standin==1.0"', 'pypi = "corral-standin>=1.0"'), "[install] pypi", 3),
    (('pypi = "corral-standin==1.0"', 'npm = "left-pad@latest"'), "[install] npm", 3),
    (('pypi = "corral-standin==1.0"', 'npm = "x@1.0.0"\npypi = "y==1"'), "[install]", 2),
    (('command = ["standin"]', "command = []"), "[run] command", 5),
    (('command = ["standin"]', 'command = "standin"'), "[run] command", 5),
    (('command = ["standin"]', 'command = ["s"]\nenvironment = { HTTPS_PROXY = "x" }'),
     "[run] environment", 6),
    (('command = ["standin"]', 'command = ["s"]\nenvironment = { LD_PRELOAD = "x" }'),
     "[run] environment", 6),
    (('command = ["standin"]', 'command = ["s"]\nshell = true'), "[run] shell", 6),
    (('description = "a stand-in"', ""), "description", None),
])
def test_a_broken_profile_is_named_by_line_and_key(change, key, line):
    old, new = change
    with pytest.raises(ConfigError) as caught:
        parse_profile(MINIMAL.replace(old, new), "team/standin.toml")
    assert caught.value.path == "team/standin.toml" and caught.value.key == key
    assert caught.value.line == line


@pytest.mark.parametrize("extra, key", [
    ('[home]\npersist = ["../escape"]\n', "[home] persist"),
    ('[home]\npersist = ["/etc"]\n', "[home] persist"),
    ('[[secret]]\nname = "K"\nhosts = ["api.test"]\nheader = "x-key"\nbearer = true\n',
     "[[secret]] K"),
    ('[[secret]]\nname = "K"\nhosts = []\n', "[[secret]] K: hosts"),
    ('[[secret]]\nname = "1K"\nhosts = ["api.test"]\n', "[[secret]] name"),
    ('[[secret]]\nname = "K"\nhosts = ["api.test"]\nheader = "x key"\n',
     "[[secret]] K: header"),
    ('[policy]\npresets = ["no-such-preset"]\n', "[policy] presets"),
    ('[policy.htttp]\nallow = ["x.test"]\n', "[policy] htttp"),
    ('[policy.approval]\nmode = "ask"\n', "[policy]"),
    ('[policy.http]\nallow = ["http://x"]\n', "[policy] [http] allow"),
])
def test_a_profile_section_that_would_loosen_or_break_something_is_refused(extra, key):
    with pytest.raises(ConfigError) as caught:
        parse_profile(MINIMAL + extra, "standin.toml")
    assert caught.value.key == key, str(caught.value)


def test_an_index_must_be_https_by_name_without_credentials():
    for index in ("http://pypi.test/simple/", "https://user:pw@pypi.test/simple/",
                  "https://203.0.113.5/simple/", "file:///tmp/x", "https:///simple"):
        text = MINIMAL.replace('==1.0"', f'==1.0"\nindex = "{index}"')
        with pytest.raises(ConfigError) as caught:
            parse_profile(text, "standin.toml")
        assert caught.value.key == "[install] index", index
    text = MINIMAL.replace('==1.0"', '==1.0"\nindex = "https://pypi.test:8443/simple/"')
    install = parse_profile(text, "standin.toml").install
    assert install.policy_text() == '[http]\nallow = ["pypi.test:8443"]\n'


def test_the_install_key_changes_with_anything_that_changes_what_is_installed():
    base = Install("npm", "tool", "1.0.0", REGISTRIES["npm"])
    keys = {base.key("image:1"), base.key("image:2"),
            Install("npm", "tool", "1.0.1", REGISTRIES["npm"]).key("image:1"),
            Install("npm", "tool", "1.0.0", "https://mirror.test/").key("image:1"),
            Install("pypi", "tool", "1.0.0", REGISTRIES["pypi"]).key("image:1")}
    assert len(keys) == 5 and base.key("image:1") == base.key("image:1")


def test_the_install_command_puts_the_package_under_the_mount_and_nothing_else():
    npm = Install("npm", "@scope/tool", "1.2.3", REGISTRIES["npm"]).command()
    assert npm[:5] == ["npm", "install", "--global", "--prefix", MOUNT]
    assert npm[-1] == "@scope/tool@1.2.3"
    pypi = Install("pypi", "tool[extra]", "2.0", "https://pypi.test/simple/").command()
    assert pypi[-3:] == [MOUNT, "https://pypi.test/simple/", "tool[extra]==2.0"]


def test_a_project_profile_wins_over_the_persons_and_corrals(tmp_path):
    project, config = tmp_path / "project", tmp_path / "config"
    for directory in (project / ".corral" / "agents", config / "agents"):
        directory.mkdir(parents=True)
        (directory / "claude.toml").write_text(MINIMAL)
    places = search_path(project, config)
    assert find("claude", places) == ("project", project / ".corral/agents/claude.toml")
    (project / ".corral/agents/claude.toml").unlink()
    assert find("claude", places)[0] == "user"
    (config / "agents/claude.toml").unlink()
    assert find("claude", places) == ("shipped", shipped() / "claude.toml")
    assert find("../claude", places) is None and find("no-such", places) is None
    assert available(places)["aider"][0] == "shipped"


POLICY_VALUES = st.recursive(
    st.one_of(st.text(max_size=20), st.integers(-10, 10**6), st.booleans()),
    lambda inner: st.lists(inner.filter(lambda v: not isinstance(v, list)), max_size=4),
    max_leaves=6)
KEYS = st.text(min_size=1, max_size=12)


@given(st.dictionaries(KEYS, st.one_of(
    POLICY_VALUES,
    st.dictionaries(KEYS, POLICY_VALUES, max_size=3),
    st.lists(st.dictionaries(KEYS, POLICY_VALUES, min_size=1, max_size=3), min_size=1,
             max_size=2)), max_size=4))
def test_a_policy_table_written_back_as_toml_reads_the_same(table):
    # what the profile's [policy] says is what the filter gets: no key or value bent
    assert tomllib.loads(toml_text(table)) == table



def test_a_pypi_install_links_only_the_packages_commands_into_bin(tmp_path):
    # run for real against a PEP 503 index on disk: the venv's own python3 and pip stay
    # out of bin/ (on the session's PATH they would shadow the image's, and pip would try
    # to install into the read-only tree); the package's command is there and runs
    index = tmp_path / "index" / "tool"
    index.mkdir(parents=True)
    wheel = index / "tool-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("tool/__init__.py", "def main():\n    print('tool ran')\n")
        archive.writestr("tool-1.0.dist-info/METADATA",
                         "Metadata-Version: 2.1\nName: tool\nVersion: 1.0\n")
        archive.writestr("tool-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: t\n"
                         "Root-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr("tool-1.0.dist-info/entry_points.txt",
                         "[console_scripts]\ntool = tool:main\n")
        archive.writestr("tool-1.0.dist-info/RECORD", "")
    (index / "index.html").write_text(f'<a href="{wheel.name}">{wheel.name}</a>\n')
    mount = tmp_path / "mount"
    install = Install("pypi", "tool", "1.0", (tmp_path / "index").as_uri() + "/")
    command = install.command()
    command[command.index(MOUNT)] = str(mount)
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    subprocess.run(command, check=True, capture_output=True, timeout=120, env=environment)
    assert sorted(p.name for p in (mount / "bin").iterdir()) == ["tool"]
    ran = subprocess.run([mount / "bin" / "tool"], capture_output=True, text=True, check=True)
    assert ran.stdout == "tool ran\n"
