"""How the battery goes into the sandbox image: one zipapp built from appliance/selftest/,
self-contained on Debian's python3, the same bytes for the same sources, and every file of
the package in the layer's digest (so a change to any probe rebuilds the layer)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from appliance.sandbox import image
from appliance.selftest import cli

SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's, as in the image
PLAIN = {"PATH": "/usr/bin:/bin"}  # nothing of the checkout or its venv


def package_files() -> list[Path]:
    return sorted(image.SELFTEST.rglob("*.py"))


@pytest.fixture
def corral_selftest(tmp_path):
    """The zipapp as the image installs it: an executable file named corral-selftest."""
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"no {SYSTEM_PYTHON} here to run the zipapp as the image does")
    path = tmp_path / "bin" / "corral-selftest"
    path.parent.mkdir()
    path.write_bytes(image.selftest_zipapp())
    path.chmod(0o755)
    return path


def run(command, cwd):
    return subprocess.run([str(c) for c in command], cwd=cwd, env=PLAIN, capture_output=True,
                          text=True, timeout=60)


def test_the_zipapp_runs_alone_on_the_system_python(corral_selftest, tmp_path):
    # the plain system python cannot import corral from where it runs: what works below, the
    # zipapp brought with it
    alone = run([SYSTEM_PYTHON, "-c", "import appliance"], tmp_path)
    assert alone.returncode != 0 and "No module named 'appliance'" in alone.stderr
    assert corral_selftest.read_bytes().startswith(b"#!/usr/bin/python3\n")

    listed = run([corral_selftest, "--list"], tmp_path)  # by its interpreter line
    assert listed.returncode == 0, listed.stderr
    here = io.StringIO()
    assert cli.main(["--list"], out=here) == 0
    assert listed.stdout == here.getvalue()  # every probe, in the same order
    assert len(listed.stdout.splitlines()) > 50

    helped = run([corral_selftest, "--help"], tmp_path)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: corral-selftest ")
    assert "Probe every bypass class" in helped.stdout and "--skip-group GROUP" in helped.stdout


def test_the_zipapp_runs_a_probe_and_answers_in_json(corral_selftest, tmp_path):
    """The review probe needs no network: the runner, the probe and the --json lines, all
    from inside the archive."""
    work = tmp_path / "work"
    work.mkdir()
    result = run([corral_selftest, "--allowed", "a.test", "--gateway", "192.0.2.1",
                  "--workdir", work, "--only", "review-hostile-files", "--json"], tmp_path)
    assert result.returncode == 0, result.stderr
    probe, summary = [json.loads(line) for line in result.stdout.splitlines()]
    assert probe["id"] == "review-hostile-files" and probe["state"] == "passed"
    assert all(os.path.lexists(work / p) for p in probe["expect"]["paths"])
    assert summary == {"summary": {"passed": 1, "failed": 0, "not_run": 0,
                                   "skipped_groups": {}, "unselected": {}}}


def test_the_zipapp_holds_every_module_and_is_the_same_bytes_for_the_same_sources():
    built = image.selftest_zipapp()
    assert built == image.selftest_zipapp()
    archive = zipfile.ZipFile(io.BytesIO(built))
    names = [f"selftest/{p.relative_to(image.SELFTEST).as_posix()}" for p in package_files()]
    assert archive.namelist() == ["__main__.py", *names]
    for path, name in zip(package_files(), names, strict=True):
        assert archive.read(name) == path.read_bytes(), name


def test_the_layer_digest_changes_when_any_file_of_the_battery_does(tmp_path):
    copy = tmp_path / "selftest"
    shutil.copytree(image.SELFTEST, copy, ignore=shutil.ignore_patterns("__pycache__"))
    base = image.layer_digest(copy)
    assert base == image.layer_digest()  # the digest is of the contents, not of where they are
    for path in sorted(copy.rglob("*.py")):
        original = path.read_bytes()
        path.write_bytes(original + b"\n")
        assert image.layer_digest(copy) != base, path.name
        path.write_bytes(original)
    assert image.layer_digest(copy) == base
    (copy / "extra.py").write_text("")
    assert image.layer_digest(copy) != base  # a new module is shipped, so digested


def test_the_layer_digest_changes_with_corral_request(tmp_path, monkeypatch):
    base = image.layer_digest()
    copy = tmp_path / "corral_request.py"
    copy.write_bytes(image.REQUEST.read_bytes())
    monkeypatch.setattr(image, "REQUEST", copy)
    assert image.layer_digest() == base
    copy.write_bytes(copy.read_bytes() + b"\n")
    assert image.layer_digest() != base
    assert image.request_script().startswith(b"#!/usr/bin/python3\n")
