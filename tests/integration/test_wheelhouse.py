"""The appliance's Python install (roles/corral_base): the role's own two shell commands, read
from its tasks file and run here by real pip, offline. The control machine's collects exactly
the locked wheels into one archive with the lock; the appliance's installs from that archive
only, checking every wheel against the lock. A wheel that is not the one the lock names is
refused with pip's hash error, at either end. No VM: the appliance's side runs in a temporary
directory with Debian's python3, as the role runs it in /opt/corral.

The project is a stand-in for corral's checkout (a corral wheel whose console script is
corral-filter, built by an in-tree backend that needs nothing from an index) and the package
index a directory of wheels made here, so no byte comes from the network."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from cli.box import role_command

ROOT = Path(__file__).resolve().parents[2]
HASH_ERROR = "THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE"


COLLECT = role_command("Build the corral wheel")
INSTALL = role_command("Install corral into its virtualenv")


def wheel(name: str, version: str, code: str, requires: tuple[str, ...] = (),
          scripts: dict[str, str] | None = None) -> tuple[str, bytes]:
    """A pure-Python wheel, by hand (a zip with a dist-info)."""
    dist = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    files = {
        f"{name}/__init__.py": code.encode(),
        f"{dist}/METADATA": metadata.encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: corral-tests\nRoot-Is-Purelib: true\n"
                         b"Tag: py3-none-any\n",
    }
    if scripts:
        files[f"{dist}/entry_points.txt"] = ("[console_scripts]\n" + "".join(
            f"{script} = {target}\n" for script, target in scripts.items())).encode()
    record = "".join(
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
        f"{len(data)}\n" for path, data in files.items()) + f"{dist}/RECORD,,\n"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path, data in [*files.items(), (f"{dist}/RECORD", record.encode())]:
            archive.writestr(zipfile.ZipInfo(path, date_time=(1980, 1, 1, 0, 0, 0)), data)
    return f"{name}-{version}-py3-none-any.whl", buffer.getvalue()


DEPENDENCY = wheel("corraldep", "1.0", "WHO = 'the locked one'\n")
TAMPERED = wheel("corraldep", "1.0", "WHO = 'someone else'\n")
CORRAL = wheel("corral", "0.1.0",
               "import corraldep\n\ndef main():\n    print('corral-filter with', corraldep.WHO)\n",
               requires=("corraldep>=1",), scripts={"corral-filter": "corral:main"})

BACKEND = '''"""Builds the corral wheel the test made (needs nothing from an index)."""
import shutil
from pathlib import Path

def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    built = next(Path(__file__).parent.glob("*.whl"))
    shutil.copy(built, wheel_directory)
    return built.name
'''


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def control(tmp_path):
    """The control machine's side: a checkout with its appliance lock, an index holding the
    locked wheel, and the environment the role gives its command (plus pip told to use that
    index only)."""
    source = tmp_path / "checkout"
    (source / "requirements").mkdir(parents=True)
    (source / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n')
    (source / "backend.py").write_text(BACKEND)
    (source / CORRAL[0]).write_bytes(CORRAL[1])
    (source / "requirements/appliance.txt").write_text(
        f"corraldep==1.0 \\\n    --hash=sha256:{sha256(DEPENDENCY[1])}\n    # via corral\n")
    index = tmp_path / "index"
    index.mkdir()
    (index / DEPENDENCY[0]).write_bytes(DEPENDENCY[1])
    environment = {
        "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
        "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(index),
        "PIP_NO_CACHE_DIR": "1",
        "PYTHON": sys.executable, "SOURCE": str(source),
        "WHEELHOUSE": str(tmp_path / "build/wheelhouse"), "ARCH": os.uname().machine,
        "PYVER": appliance_python(), "SOURCE_DATE_EPOCH": "315532800",
    }
    return environment, index


def appliance_python() -> str:
    out = subprocess.run(["/usr/bin/python3", "-c", "import sys; print(sys.version_info[:2])"],
                         capture_output=True, text=True, check=True).stdout
    major, minor = out.strip("()\n").split(", ")
    return f"{major}.{minor}"


def run(command: str, environment: dict, cwd: Path | None = None):
    return subprocess.run(["/bin/sh", "-c", command], env=environment, cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def collect(environment: dict) -> Path:
    result = run(COLLECT, environment)
    assert result.returncode == 0, result.stderr
    return Path(environment["WHEELHOUSE"] + ".tar")


def appliance(tmp_path: Path, archive: bytes) -> Path:
    """/opt/corral as the copy task leaves it: the archive, and whatever was there before."""
    prefix = tmp_path / "opt-corral"
    prefix.mkdir(exist_ok=True)
    (prefix / "wheelhouse.tar").write_bytes(archive)
    return prefix


def install(prefix: Path):
    return run(INSTALL, {"PATH": "/usr/bin:/bin", "HOME": str(prefix),
                         "PIP_CONFIG_FILE": os.devnull}, cwd=prefix)


def test_the_appliance_installs_the_locked_wheels_and_the_lock_rides_along(control, tmp_path):
    environment, _ = control
    archive = collect(environment)
    with tarfile.open(archive) as tar:
        members = sorted(m.name.removeprefix("./") for m in tar if m.isfile())
    assert members == ["appliance.txt", CORRAL[0], DEPENDENCY[0]]
    first = archive.read_bytes()
    assert collect(environment).read_bytes() == first  # same inputs, same archive: no change

    prefix = appliance(tmp_path, first)
    result = install(prefix)
    assert (result.returncode, result.stdout) == (0, "installed\n"), result.stderr
    said = subprocess.run([prefix / "venv/bin/corral-filter"], capture_output=True, text=True)
    assert said.stdout == "corral-filter with the locked one\n"
    assert (prefix / "venv/.corral-wheels").read_text().split()[0] == sha256(first)
    again = install(prefix)
    assert (again.returncode, again.stdout) == (0, "current\n"), again.stderr


def test_a_wheel_unlike_the_lock_is_refused_on_the_control_machine(control):
    environment, index = control
    (index / TAMPERED[0]).write_bytes(TAMPERED[1])
    result = run(COLLECT, environment)
    assert result.returncode != 0
    assert HASH_ERROR in result.stderr
    assert sha256(TAMPERED[1]) in result.stderr
    assert not Path(environment["WHEELHOUSE"] + ".tar").exists()


def test_a_wheel_unlike_the_lock_is_refused_on_the_appliance(control, tmp_path):
    """The archive's lock is what the appliance checks: a wheel swapped in the archive (on
    the way, or in the build directory) fails the task with pip's hash error, installs
    nothing and marks nothing installed, so the next run tries again."""
    environment, _ = control
    swapped = io.BytesIO()
    with tarfile.open(collect(environment)) as collected, \
            tarfile.open(fileobj=swapped, mode="w") as tar:
        for member in collected:
            data = collected.extractfile(member).read() if member.isfile() else None
            if member.name.endswith(DEPENDENCY[0]):
                data = TAMPERED[1]
                member.size = len(data)
            tar.addfile(member, io.BytesIO(data) if data is not None else None)
    prefix = appliance(tmp_path, swapped.getvalue())

    result = install(prefix)
    assert result.returncode != 0
    assert HASH_ERROR in result.stderr
    assert sha256(TAMPERED[1]) in result.stderr
    assert not (prefix / "venv/.corral-wheels").exists()
    assert not (prefix / "venv/bin/corral-filter").exists()
