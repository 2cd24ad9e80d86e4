"""The host CLI: commands, exit codes, and the import boundary."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from cli import exitcodes
from cli.main import main

ALLOWED_APPLIANCE_IMPORTS = {"appliance.agents", "appliance.event", "appliance.policy",
                             "appliance.pki", "appliance.workspace", "appliance.manifest",
                             "appliance.argtypes"}
"""What both sides read the same way: profiles and policies are parsed on the host (to check
them early) and again on the appliance (which trusts only its own reading); manifests are
compared on the host (`corral verify --against`) and on the appliance (`check`); seconds on
a command line (argtypes, standard library only)."""


def test_cli_imports_only_policy_pki_workspace_and_agent_profiles_from_appliance():
    for path in [*Path("cli").rglob("*.py"), *Path("appliance/agents").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module == "appliance":
                names = [f"appliance.{a.name}" for a in node.names]  # from appliance import pki
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name == "appliance" or name.startswith("appliance."):
                    top = ".".join(name.split(".")[:2])
                    assert top in ALLOWED_APPLIANCE_IMPORTS, f"{path}: imports {name}"


def test_the_shared_workspace_module_is_standard_library_only():
    """The CLI may import it because it pulls in nothing: keep it that way."""
    import sys

    sources = sorted(Path("appliance/workspace").glob("*.py"))
    assert sources
    for source in sources:
        tree = ast.parse(source.read_text())
        modules = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                   for a in n.names}
        modules |= {n.module.split(".")[0] for n in ast.walk(tree)
                    if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}
        assert modules - {"__future__"} <= sys.stdlib_module_names, (source, modules)


def test_the_boundary_check_catches_a_forbidden_import(tmp_path, monkeypatch):
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "bad.py").write_text("from appliance import filter\n")
    monkeypatch.chdir(tmp_path)
    try:
        test_cli_imports_only_policy_pki_workspace_and_agent_profiles_from_appliance()
    except AssertionError as exc:
        assert "imports appliance.filter" in str(exc)
    else:
        raise AssertionError("a forbidden import went unnoticed")


def test_check_prints_rules_with_sources(tmp_path, capsys):
    (tmp_path / "corral.toml").write_text('presets = ["npm"]\n[http]\nallow = ["a.example"]\n')
    assert main(["check", str(tmp_path / "corral.toml")]) == exitcodes.OK
    out = capsys.readouterr().out
    assert "a.example" in out and "preset:npm" in out and "registry.npmjs.org" in out


def test_check_json(tmp_path, capsys):
    (tmp_path / "corral.toml").write_text('[dns]\nallow = ["a.example"]\n')
    assert main(["check", str(tmp_path / "corral.toml"), "--json"]) == exitcodes.OK
    rules = json.loads(capsys.readouterr().out)["rules"]
    assert {"kind": "dns", "rule": "a.example", "layer": "project",
            "source": str(tmp_path / "corral.toml")} in rules


def test_check_error_names_line_and_gives_a_hint(tmp_path, capsys):
    (tmp_path / "corral.toml").write_text('[http]\nallow = ["no good"]\n')
    assert main(["check", str(tmp_path / "corral.toml")]) == exitcodes.USAGE
    err = capsys.readouterr().err
    assert "corral.toml:2: [http] allow: 'no good'" in err and "hint:" in err


def test_presets_json(capsys):
    assert main(["presets", "--json"]) == exitcodes.OK
    names = {p["name"] for p in json.loads(capsys.readouterr().out)}
    assert {"pypi", "github", "golang"} <= names


def test_selftest_summary_says_what_failed_was_not_recorded_did_not_run_or_was_left_out():
    from cli.selftest import selftest_summary

    def probe(state, **extra):
        return {"id": "p", "state": state, **extra}

    result = {"probes": [probe("passed"), probe("failed", unrecorded=True), probe("failed"),
                         probe("not-run")],
              "summary": {"skipped_groups": {"kernel": ["a", "b"]},
                          "unselected": {"x": "needs --private-name"}}}
    assert selftest_summary(result, "s1") == (
        "1/4 probes passed in s1; 2 failed (1 denied but not recorded); 1 not run (could not "
        "be tried: see DETAIL); group kernel skipped (2 probes); 1 not selected (an option "
        "they need was not given)")
    assert selftest_summary({"probes": [probe("passed")], "summary": {}}, "s1") == (
        "1/1 probes passed in s1")
    assert selftest_summary({"probes": [probe("passed")], "summary": None}, "s1").endswith(
        "; the battery did not finish")


@pytest.mark.parametrize(("text", "seconds"), [
    ("90s", 90), ("10m", 600), ("1h30m", 5400), ("2d", 172800), ("1d2h3m4s", 93784)])
def test_for_takes_a_duration(text, seconds):
    from cli.times import parse_duration

    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "10", "10x", "m", "0s", "1m1h", "-5m"])
def test_for_refuses_what_is_not_a_duration_with_the_fix(text):
    from cli.client import CliError
    from cli.times import parse_duration

    with pytest.raises(CliError) as refused:
        parse_duration(text)
    assert refused.value.code == 2 and "--for" in str(refused.value)


def test_check_warns_about_a_tcp_rule_that_reaches_an_inspected_host_uninspected(tmp_path,
                                                                                capsys):
    """A tcp rule goes through nftables, straight to the host's address: no request rule, no
    git confinement, no leak scan applies there (issue 26, F16)."""
    path = tmp_path / "corral.toml"
    path.write_text('[tcp]\nallow = ["*.example.com:22", "api.example.com:443", '
                    '"other.example.net:5432"]\n[[inspect]]\nhost = "api.example.com"\n'
                    'deny = ["DELETE /**"]\n')
    assert main(["check", str(path)]) == exitcodes.OK
    captured = capsys.readouterr()
    warned = [line for line in captured.err.splitlines() if "warning" in line]
    # 443 is redirected to the proxy, which inspects it; port 22 is not
    assert len(warned) == 1, captured.err
    assert "tcp rule *.example.com:22" in warned[0] and "api.example.com" in warned[0]
    assert "not inspected" in warned[0]
    assert main(["check", str(path), "--json"]) == exitcodes.OK
    (warning,) = json.loads(capsys.readouterr().out)["warnings"]
    assert warning.startswith("tcp rule *.example.com:22")
    path.write_text('presets = ["github"]\n[[git]]\nhost = "github.com"\nrepos = ["acme/w"]\n')
    assert main(["check", str(path)]) == exitcodes.OK
    assert "tcp rule github.com:22 (preset:github)" in capsys.readouterr().err


def throwaway_policy(*args, **kwargs):
    """The policy of the throwaway session `corral selftest` starts (its corral.toml)."""
    import tarfile

    from appliance.policy import Policy, policy_file_rules
    from cli.selftest import _empty_project

    data, _ = _empty_project(*args, **kwargs)
    with tarfile.open(fileobj=data, mode="r:gz") as tar:
        names = tar.getnames()
        if "corral.toml" not in names:
            return Policy([])
        text = tar.extractfile("corral.toml").read().decode()
    return Policy(policy_file_rules(text, "corral.toml", "project"))


@pytest.mark.parametrize("inspected", ["inspected.test", None])
def test_a_throwaway_session_allows_the_host_of_echo_secret(inspected):
    """`corral selftest --echo-secret NAME@HOST` without a session: the secret's host must be
    allowed by [http] for its placeholder to be replaced (docs/secrets.md), so the
    throwaway's policy allows it, with or without --inspected; nothing else is added."""
    from appliance.policy import parse_host

    policy = throwaway_policy(inspected, echo_secret="ECHO_TOKEN@echo.test")
    assert policy.decide_http(parse_host("echo.test"), 443).allowed
    assert not policy.decide_http(parse_host("other.test"), 443).allowed
    if inspected:
        assert policy.inspection(parse_host(inspected)) is not None
    assert policy.inspection(parse_host("echo.test")) is None  # its secret inspects it


def test_a_throwaway_session_without_options_has_no_policy_file():
    from appliance.policy import parse_host

    policy = throwaway_policy(None, echo_secret="not-a-name-at-a-host")
    assert not policy.decide_http(parse_host("not-a-name-at-a-host"), 443).allowed


def test_the_battery_proves_the_legitimate_path_on_a_host_no_probe_treats_otherwise():
    """Without --allowed, the legitimate flows go to the session's first exact http host
    that is neither --inspected (its TLS is ended), --neighbour (on an inspected host's
    address: refused a tunnel by design) nor --echo-secret's host (a secret inspects it)."""
    from cli.selftest import plain_allowed

    rules = [{"kind": "deny", "rule": "metadata.google.internal"},
             *({"kind": "http", "rule": r} for r in (
                 "*.cdn.test", "inspected.test", "neighbour.test", "echo.test:443",
                 "allowed.test", "later.test"))]
    assert plain_allowed(rules, ["inspected.test", "neighbour.test", "echo.test"]) == (
        "allowed.test")
    assert plain_allowed(rules[:-2], ["inspected.test", "neighbour.test", "echo.test"]) is None


def test_the_parser_loads_neither_flask_nor_the_dashboard_server():
    """Only `corral dashboard` needs Flask: its module registers the command without it."""
    import subprocess
    import sys

    probe = ("import sys; from cli.main import parser; parser().parse_args(['presets']); "
             "print(sorted(m for m in ('flask', 'werkzeug', 'cli.dashboard.server') "
             "if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            check=True).stdout.strip()
    assert loaded == "[]", loaded
