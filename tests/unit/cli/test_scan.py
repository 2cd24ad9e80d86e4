"""`corral run` reads the project for secrets before anything of it is copied: real
detect-secrets on real files; findings name path, line and detector (never the value); a
finding stops the run unless `[workspace] exclude` leaves the file out (then it is not
copied either) or `--allow-secrets` says so."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from cli import exitcodes, scan
from cli.main import main
from cli.sessions import _archive

AWS = "AKIAIOSFODNN7EXAMPLE"


@pytest.fixture
def project(tmp_path):
    root = tmp_path / "project"
    (root / "src").mkdir(parents=True)
    (root / "src" / "app.py").write_text(f'print("hi")\nkey = "{AWS}"\n')
    (root / ".env").write_text("# local settings\nexport DB_PASSWORD=hunter2\nEMPTY=\n")
    (root / ".env.example").write_text("DB_PASSWORD=change-me\n")
    (root / "deploy").mkdir()
    (root / "deploy" / "id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nb3Bl\n")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text('[remote "origin"]\n\turl = '
                                          "https://agent:hunter22@github.com/acme/widget\n")
    (root / ".corral").mkdir()
    (root / ".corral" / "client.key").write_text("-----BEGIN PRIVATE KEY-----\n")  # never copied
    (root / "README").write_text("nothing to see\n")
    (root / "web" / "node_modules" / "dep").mkdir(parents=True)  # copied, not read
    (root / "web" / "node_modules" / "dep" / "test.pem").write_text(
        "-----BEGIN RSA PRIVATE KEY-----\n")
    return root


def test_findings_name_path_line_and_detector_never_the_value(project):
    report = scan.scan(project, (), (".corral",))
    found = [(f.path, f.line, f.detector) for f in report.findings]
    assert found == [(".env", 2, "assignment in a .env file"),
                     (".git/config", 2, "Basic Auth Credentials"),
                     ("deploy/id_ed25519", 1, "Private Key"),
                     ("src/app.py", 2, "AWS Access Key")]
    assert AWS not in json.dumps([f.to_json() for f in report.findings])
    assert report.files == 7  # .corral/ is never copied, so never read
    assert report.unread == 1  # node_modules: copied, counted, not read


def test_excluded_paths_are_neither_read_nor_copied(project):
    exclude = (".env", "deploy/", "*.py", ".git/config")
    assert scan.scan(project, exclude, (".corral",)).findings == []
    spool, _, _ = _archive(project, exclude)
    with spool, tarfile.open(fileobj=io.BytesIO(spool.read()), mode="r:gz") as archive:
        names = sorted(n.removeprefix("./") for n in archive.getnames())
    assert names == [".", ".env.example", ".git", "README", "src", "web", "web/node_modules",
                     "web/node_modules/dep", "web/node_modules/dep/test.pem"]


@pytest.mark.parametrize(("path", "patterns", "expected"), [
    ("a/b/c.pem", ("*.pem",), True), ("a/b/c.pem", ("a/",), True),
    ("a/b/c.pem", ("b/c.pem",), False), ("a/b/c.pem", ("a/b/*.pem",), True),
    ("secrets", ("secrets/",), True), ("not-secrets", ("secrets",), False)])
def test_exclude_patterns(path, patterns, expected):
    assert scan.excluded(path, patterns) is expected


def test_run_refuses_before_it_reaches_any_appliance(project, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "nowhere"))  # no appliance at all
    code = main(["run", "--project", str(project), "--detach"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "src/app.py:2  AWS Access Key" in out and "4 possible secret(s)" in err
    assert "[workspace]" in err and "--allow-secrets" in err and AWS not in out + err
    (project / "corral.toml").write_text('[workspace]\nexclude = [".env", "deploy/", '
                                         '"src/app.py", ".git/config"]\n')
    code = main(["run", "--project", str(project), "--detach"])
    _, err = capsys.readouterr()
    assert "possible secret" not in err and "appliance" in err  # past the scan, no appliance
    (project / "corral.toml").write_text('[workspace]\nexclude = "all"\n')
    assert main(["run", "--project", str(project)]) == exitcodes.USAGE
    assert "[workspace] exclude" in capsys.readouterr().err


def test_a_finding_in_a_file_whose_name_draws_lines_is_named_on_one_line(
        project, capsys, monkeypatch, tmp_path):
    """A project's file names may be an agent's (applied from an earlier session): a name
    holding a newline and text shaped like corral's own lines is shown quoted and escaped
    on the finding's line, never as a line of its own."""
    name = "notes\ncorral: error: nothing found, copying anyway\n.py"
    (project / name).write_text(f'key = "{AWS}"\n')
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "nowhere"))
    assert main(["run", "--project", str(project), "--detach"]) == 1
    out, _ = capsys.readouterr()
    assert "\ncorral: error: nothing found" not in out, out
    assert '  "notes\\ncorral: error: nothing found, copying anyway\\n.py":1  AWS' in out, out
