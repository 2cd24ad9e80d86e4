"""The lock files (requirements/, written by scripts/lock): every package pinned with hashes,
and exactly pyproject.toml's dependencies asked for: the dev lock `.[host,test]` and the build
backend (scripts/setup), the appliance's lock the base dependencies alone (roles/corral_base).
Read offline: whether a newer release exists is `scripts/lock --check`'s question."""

from __future__ import annotations

import itertools
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
ASKED_BY_PYPROJECT = "corral (pyproject.toml)"
"""How uv's `# via` comment names a package pyproject.toml asks for itself."""


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    marker: Marker | None
    hashes: tuple[str, ...]
    via: tuple[str, ...]
    """What asks for it, as uv's comment says."""
    line: int


def parse_lock(text: str, where: str) -> list[Pin]:
    """The pins of a lock as uv writes it: a requirement, its `--hash=` lines (each but the
    last ending in a backslash), then `# via` comments. Anything else is an error naming the
    line: a lock holds pins and nothing that could change where they come from."""
    pins: list[Pin] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        if not line.strip() or line.startswith("#"):
            continue
        number = index
        if line.startswith((" ", "-")):
            raise AssertionError(f"{where}:{number}: not a pin: {line!r}")
        requirement = Requirement(line.removesuffix("\\").strip())
        pinned = [str(spec) for spec in requirement.specifier]
        assert len(pinned) == 1 and pinned[0].startswith("=="), \
            f"{where}:{number}: {line!r} is not pinned to one version (==)"
        hashes, via = [], []
        continued = line.endswith("\\")
        while index < len(lines) and lines[index].startswith("    "):
            part = lines[index].strip()
            index += 1
            if continued:
                match = re.fullmatch(r"--hash=sha256:([0-9a-f]{64})( \\)?", part)
                assert match, f"{where}:{index}: not a sha256 hash: {part!r}"
                hashes.append(match[1])
                continued = bool(match[2])
            elif part.startswith("# via"):
                via.append(part.removeprefix("# via").strip())
            elif part.startswith("#   "):
                via.append(part.removeprefix("#   ").strip())
            else:
                raise AssertionError(f"{where}:{index}: unexpected line {part!r}")
        pins.append(Pin(canonicalize_name(requirement.name), pinned[0][2:], requirement.marker,
                        tuple(hashes), tuple(v for v in via if v), number))
    return pins


def lock(name: str) -> list[Pin]:
    return parse_lock((ROOT / "requirements" / name).read_text(), f"requirements/{name}")


def asked(*extras: str, build: bool = False) -> dict[str, list[Requirement]]:
    """pyproject.toml's requirements by name: the base dependencies, the extras named and the
    build backend."""
    project = PYPROJECT["project"]
    specs = [*project["dependencies"],
             *(spec for extra in extras for spec in project["optional-dependencies"][extra]),
             *(PYPROJECT["build-system"]["requires"] if build else [])]
    by_name: dict[str, list[Requirement]] = {}
    for spec in specs:
        requirement = Requirement(spec)
        by_name.setdefault(canonicalize_name(requirement.name), []).append(requirement)
    return by_name


LOCKS = {"dev.txt": asked("host", "test", build=True), "appliance.txt": asked()}


@pytest.mark.parametrize("name", LOCKS)
def test_every_package_pyproject_asks_for_is_pinned_in_the_lock(name):
    pinned = {pin.name for pin in lock(name)}
    missing = sorted(set(LOCKS[name]) - pinned)
    assert not missing, f"requirements/{name} lacks {missing}: run scripts/lock"


@pytest.mark.parametrize("name", LOCKS)
def test_the_lock_asks_for_exactly_what_pyproject_asks_for(name):
    """uv names pyproject.toml beside each package it asks for: a package it no longer asks
    for (or not in this lock's extras) is left in no lock."""
    said = {pin.name for pin in lock(name) if ASKED_BY_PYPROJECT in pin.via}
    build = set(asked(build=True)) - set(asked())  # given on uv's standard input, unnamed
    assert said == set(LOCKS[name]) - build, f"requirements/{name}: run scripts/lock"


@pytest.mark.parametrize("name", LOCKS)
def test_every_pin_carries_hashes(name):
    pins = lock(name)
    assert pins
    for pin in pins:
        assert pin.hashes, f"requirements/{name}:{pin.line}: {pin.name} has no --hash"


@pytest.mark.parametrize("name", LOCKS)
def test_every_pin_is_in_pyprojects_range(name):
    """A raised floor in pyproject.toml without a new lock fails here, offline."""
    for pin in lock(name):
        for requirement in LOCKS[name].get(pin.name, []):
            assert requirement.specifier.contains(pin.version, prereleases=True), \
                f"requirements/{name}:{pin.line}: {pin.name}=={pin.version} is outside " \
                f"pyproject.toml's {requirement}: run scripts/lock"


def test_the_appliance_runs_the_versions_the_tests_ran():
    dev = {(pin.name, str(pin.marker)): pin for pin in lock("dev.txt")}
    for pin in lock("appliance.txt"):
        twin = next((d for (name, _), d in dev.items() if name == pin.name
                     and d.version == pin.version), None)
        assert twin, f"requirements/appliance.txt:{pin.line}: {pin.name}=={pin.version} " \
                     "is not the dev lock's version: run scripts/lock"
        assert set(pin.hashes) == set(twin.hashes), pin.name


def test_the_appliance_lock_reads_the_same_on_every_linux_cpython():
    """The role's `pip download` reads the lock's markers with the control machine's Python
    (3.11 on Debian 12), not the appliance's (3.13 on Debian 13): a pin for some Python
    versions only would be fetched for the wrong one, or not at all. So every marker of this
    lock must say the same for every Linux CPython pyproject allows."""
    def environment(python: str, machine: str) -> dict[str, str]:
        return {"python_version": python, "python_full_version": f"{python}.0",
                "implementation_name": "cpython", "platform_python_implementation": "CPython",
                "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
                "platform_machine": machine, "implementation_version": f"{python}.0",
                "platform_release": "", "platform_version": "", "extra": ""}
    targets = [environment(python, machine) for python, machine in
               itertools.product(("3.11", "3.12", "3.13", "3.14"), ("x86_64", "aarch64"))]
    for pin in lock("appliance.txt"):
        if pin.marker is not None:
            answers = {pin.marker.evaluate(target) for target in targets}
            assert len(answers) == 1, \
                f"requirements/appliance.txt:{pin.line}: {pin.name}; {pin.marker} differs " \
                "between Linux CPythons"


def test_a_lock_line_that_is_no_pin_is_refused():
    with pytest.raises(AssertionError, match="lock:2: not a pin"):
        parse_lock("# a comment\n--index-url https://example.invalid/simple\n", "lock")
    with pytest.raises(AssertionError, match="not pinned to one version"):
        parse_lock("flask>=3.0 \\\n    --hash=sha256:" + "a" * 64 + "\n", "lock")


def test_the_venv_runs_on_debians_interpreter():
    """scripts/setup makes .venv with /usr/bin/python3, the interpreter the appliance runs and
    the one Debian's nftables and libvirt bindings are built for; never the first python3 on
    PATH (a pyenv build without PGO measured the filter's loop about 2x slower)."""
    import os
    import sys
    if not Path("/usr/bin/python3").exists():
        pytest.skip("no /usr/bin/python3: not a Debian host")
    assert os.path.realpath(sys._base_executable) == os.path.realpath("/usr/bin/python3"), (
        f"{sys.executable} runs on {sys._base_executable}: run scripts/setup, which makes "
        ".venv again with /usr/bin/python3")
