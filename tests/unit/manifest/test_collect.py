"""The collector's file readers on a temporary tree: the wheels in a venv (their installed
files against RECORD, the wheel they came from, the lock file's hashes) and the rendered
files (what is left out, what is masked)."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

from appliance.manifest import compare
from appliance.manifest.collect import files, wheels


def fake_venv(root: Path, code: bytes = b"VALUE = 1\n") -> Path:
    """A venv holding one distribution, `demo` 1.0, installed as pip installs a wheel."""
    venv = root / "venv"
    site = venv / "lib/python3.11/site-packages"
    (site / "demo").mkdir(parents=True)
    (site / "demo/__init__.py").write_bytes(code)
    info = site / "demo-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: Demo\nVersion: 1.0\n")
    digest = base64.urlsafe_b64encode(hashlib.sha256(code).digest()).rstrip(b"=").decode()
    (info / "RECORD").write_text(f"demo/__init__.py,sha256={digest},{len(code)}\n"
                                 "demo-1.0.dist-info/METADATA,,\ndemo-1.0.dist-info/RECORD,,\n")
    return venv


def test_an_edited_installed_file_changes_its_wheels_digest_not_its_version(tmp_path):
    venv = fake_venv(tmp_path)
    before = wheels(venv)
    assert before["demo"]["version"] == "1.0"
    (venv / "lib/python3.11/site-packages/demo/__init__.py").write_text("VALUE = 2\n")
    after = wheels(venv)
    assert [str(d) for d in compare({"wheels": before}, {"wheels": after}).differences] == [
        f"wheel demo: 1.0 sha256 {before['demo']['sha256'][:12]}… -> "
        f"1.0 sha256 {after['demo']['sha256'][:12]}…"]


def test_the_wheel_it_came_from_is_checked_against_the_lock_file(tmp_path):
    venv = fake_venv(tmp_path)
    (tmp_path / "wheels").mkdir()
    archive = tmp_path / "wheels/demo-1.0-py3-none-any.whl"
    archive.write_bytes(b"a wheel")
    wheel = hashlib.sha256(b"a wheel").hexdigest()
    lock = tmp_path / "appliance.txt"
    lock.write_text(f"demo==1.0 \\\n    --hash=sha256:{wheel}\n")
    assert wheels(venv, tmp_path / "wheels", lock)["demo"]["locked"] == "yes"
    lock.write_text("demo==0.9 \\\n    --hash=sha256:00\n")
    assert wheels(venv, tmp_path / "wheels", lock)["demo"]["locked"] == (
        "no: the lock file has 0.9 with other hashes")
    assert "locked" not in wheels(venv, tmp_path / "wheels", tmp_path / "none.txt")["demo"]


def test_rendered_files_leave_out_keys_certificates_and_the_manifest(tmp_path):
    for name in ("etc/corral/filter.toml", "etc/corral/api/server.key", "etc/corral/api/ca.crt",
                 "etc/corral/manifest.json", "etc/corral/.manifest.json.x1y2",
                 "etc/systemd/system/corral-api.service",
                 "etc/systemd/system/corral-api.service.d/override.conf",
                 "etc/systemd/system/ssh.service", "etc/sysctl.d/60-corral.conf"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"{name}\n")
    assert sorted(files(tmp_path, {})) == [
        "/etc/corral/filter.toml", "/etc/sysctl.d/60-corral.conf",
        "/etc/systemd/system/corral-api.service",
        "/etc/systemd/system/corral-api.service.d/override.conf"]
