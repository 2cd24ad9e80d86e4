"""Read a running appliance into a manifest: run as root on the appliance, in corral's venv.

Each reader wraps one tool's machine-readable output (dpkg-query's format string, podman's
JSON, `systemctl is-*`'s one word, nftables' JSON) or reads files. `root` is where the
files are looked for (/ on an appliance; a temporary tree in tests); packages, images, units
and the loaded ruleset are this machine's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from . import (
    AS_RENDERED,
    build,
    digest_json,
    dpkg_query,
    mask,
    normalise_name,
    parse_dpkg,
    parse_lock,
)
from . import ruleset as tables

CONFIG_DIR = "etc/corral"
FILTER_CONFIG = f"{CONFIG_DIR}/filter.toml"
MANIFEST = f"{CONFIG_DIR}/manifest.json"
UNIT_DIR = "etc/systemd/system"
OTHER_FILES = ("etc/sysctl.d/60-corral.conf", "etc/systemd/resolved.conf.d/corral.conf",
               "usr/local/share/ca-certificates/corral-*.crt")
"""Files corral's roles write outside /etc/corral (the units are found by their names)."""
NOT_CONFIG = ("manifest.json", "api/")
"""Under /etc/corral but not configuration: the manifest itself, and the API's key and
certificates (one set per appliance, rotated by rotate-certs.yml)."""


MASKED = ("host_gateway",)
"""Appliance values masked in files: those a rendered file holds (not the hostname, a word
such as `debian` that a policy file may hold for another reason)."""


UNREADABLE = "unknown: the configuration does not parse"
"""ruleset.loaded when filter.toml (or a file it names) no longer parses: each part that
reads it says so, by name, beside the file's own difference."""


class CollectError(RuntimeError):
    """A fact that could not be read, with what to do about it."""


def _run(argv: list[str], env: dict | None = None, check: bool = True) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                              env={**os.environ, **(env or {})})
    except OSError as exc:
        raise CollectError(f"{argv[0]}: {exc.strerror}") from None
    if check and done.returncode != 0:
        raise CollectError(f"`{' '.join(argv)}` failed (exit {done.returncode}): "
                           f"{done.stderr.strip()}")
    return done.stdout


def packages() -> dict[str, str]:
    return parse_dpkg(_run(dpkg_query()))


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _installed_digest(dist: metadata.Distribution) -> str:
    """sha256 over the distribution's files as they are now (path and sha256 of each file
    its RECORD lists with a hash): an edited or missing file changes it."""
    lines = []
    for entry in dist.files or []:
        if entry.hash is None:  # RECORD itself, bytecode: not part of what was installed
            continue
        path = Path(entry.locate())
        try:
            found = _file_sha256(path)
        except OSError:
            found = "missing"
        lines.append(f"{entry}\t{found}")
    return hashlib.sha256("\n".join(sorted(lines)).encode()).hexdigest()


def wheels(venv: Path, wheel_dir: Path | None = None, lock: Path | None = None) -> dict:
    """Each distribution in the venv: version, digest of its installed files and, where the
    wheels it was installed from are kept (`wheel_dir`), the wheel's sha256, checked against
    the lock file's hashes when there is one."""
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise CollectError(f"no site-packages under {venv}: is it corral's venv?")
    archives = {}
    for archive in sorted(wheel_dir.glob("*.whl")) if wheel_dir and wheel_dir.is_dir() else []:
        name, version = archive.name.split("-")[:2]
        archives[(normalise_name(name), version)] = _file_sha256(archive)
    locked = parse_lock(lock.read_text()) if lock and lock.is_file() else None
    out = {}
    for dist in metadata.distributions(path=[str(p) for p in found]):
        name = normalise_name(dist.metadata["Name"])
        entry = {"version": dist.version, "sha256": _installed_digest(dist)}
        wheel = archives.get((name, dist.version))
        if wheel:
            entry["wheel"] = wheel
        if locked is not None and wheel:
            pin = locked.get(name)
            entry["locked"] = ("yes" if pin and f"sha256:{wheel}" in pin["hashes"]
                               else "no: not in the lock file" if pin is None
                               else f"no: the lock file has {pin['version']} with other hashes")
        out[name] = entry
    return out


IMAGES = "localhost/corral-"
"""corral's own images (the sandbox image and its base); a team's images layered on top
are the team's business, not what provisioning made."""


def images(root: Path) -> dict[str, str]:
    """corral's podman images (the sandbox images) and their ids: the image's content."""
    if shutil.which("podman") is None:
        return {}
    conf = root / CONFIG_DIR / "containers.conf"
    listed = json.loads(_run(["podman", "images", "--format", "json"],
                             {"CONTAINERS_CONF": str(conf)} if conf.is_file() else None) or "[]")
    return {name: f"sha256:{image['Id']}" for image in listed
            for name in image.get("Names") or [] if name.startswith(IMAGES)}


def files(root: Path, appliance: dict[str, str]) -> dict[str, str]:
    """sha256 of every file corral's roles render, by its path on the appliance; values in
    `appliance` are masked (they differ between appliances by design)."""
    paths = [p for p in (root / CONFIG_DIR).rglob("*") if p.is_file()
             and not any(str(p.relative_to(root / CONFIG_DIR)).startswith(n) for n in NOT_CONFIG)
             and not p.name.startswith((".manifest.json.", ".corral-"))]
    units = root / UNIT_DIR
    paths += [p for p in units.glob("corral-*") if p.is_file()]
    paths += [p for p in units.glob("corral-*.d/*") if p.is_file()]
    for pattern in OTHER_FILES:
        paths += [p for p in root.glob(pattern) if p.is_file()]
    return {"/" + str(p.relative_to(root)): hashlib.sha256(mask(p.read_bytes(), appliance))
            .hexdigest() for p in sorted(set(paths))}


def units(root: Path) -> dict[str, str]:
    """Each corral unit installed: `systemctl is-enabled` and `is-active` (unknown where
    systemd is not running)."""
    names = sorted(p.name.removesuffix(".service")
                   for p in (root / UNIT_DIR).glob("corral-*.service") if p.is_file())
    systemd = shutil.which("systemctl") and Path("/run/systemd/system").is_dir()
    out = {}
    for name in names:
        if not systemd:
            out[name] = "unknown unknown"
            continue
        enabled = _run(["systemctl", "is-enabled", name], check=False).strip() or "unknown"
        active = _run(["systemctl", "is-active", name], check=False).strip() or "unknown"
        out[name] = f"{enabled} {active}"
    return out


def render_listing(config_path: str, sessions: bool) -> list[dict]:
    """The ruleset the config renders, loaded into a scratch network namespace and listed
    back (`unshare --net`): how nft lists it, without touching the loaded one."""
    argv = ["unshare", "--net", sys.executable, "-P", "-m", "appliance.manifest", "render-ruleset",
            "--config", config_path, *(["--sessions"] if sessions else [])]
    return json.loads(_run(argv))


def render_in_this_namespace(config_path: str, sessions: bool) -> list[dict]:
    """For `render-ruleset`, already in a scratch namespace: load, list."""
    from appliance.firewall.nft import Nft
    from appliance.firewall.ruleset import build, for_store
    from appliance.policystore import PolicyStore
    from appliance.sessionconfig import load_config

    config = load_config(config_path)
    commands = (for_store(PolicyStore(config)) if sessions
                else build(dataclasses.replace(config, sessions=())))
    nft = Nft()
    nft.apply(commands)
    return nft.list_table() or []


def ruleset(config_path: str) -> tuple[dict, list[str]]:
    """The sessionless ruleset's digest, and whether the loaded table is what the config
    renders for the sessions the filter has now (their chains and rules, not their learned
    elements); with the differences named when it is not."""
    from appliance.firewall.nft import Nft
    from appliance.sessionconfig import load_config

    load_config(config_path)  # a broken file is named here, not by the scratch namespace
    rendered = tables.digest(render_listing(config_path, sessions=False))
    loaded = Nft().list_table()
    if loaded is None:
        return {"rendered": rendered, "loaded": "missing: no table inet corral"}, []
    expected = render_listing(config_path, sessions=True)
    if tables.normalise(loaded) == tables.normalise(expected):
        return {"rendered": rendered, "loaded": AS_RENDERED}, []
    return ({"rendered": rendered, "loaded": "differs from rendered"},
            tables.differences(loaded, expected))


def policy(config_path: str) -> dict[str, str]:
    """The effective appliance policy (built-in defaults and the appliance's files, as the
    filter compiles them) as its digest."""
    from appliance.policystore import PolicyStore
    from appliance.sessionconfig import load_config

    return {"appliance": digest_json(PolicyStore(load_config(config_path)).effective(None))}


def appliance_values(root: Path, name: str) -> dict[str, str]:
    """What differs between two appliances from one commit by design."""
    from appliance.sessionconfig import load_config

    values = {"name": name, "hostname": os.uname().nodename}
    config = root / FILTER_CONFIG
    try:
        gateway = load_config(str(config)).gateway
    except ValueError:  # unreadable: the file's own difference and `ruleset` say so
        gateway = None
    if gateway is not None:
        values["host_gateway"] = str(gateway)
    return values


def collect(root: Path, venv: Path, name: str, commit: str, wheel_dir: Path | None = None,
            lock: Path | None = None, settle: float = 0) -> tuple[dict, list[str]]:
    """The running appliance's manifest, and notes explaining a ruleset that differs.
    `settle`: seconds to wait for the loaded ruleset to become the rendered one (the filter
    loads it a moment after it starts)."""
    config = str(root / FILTER_CONFIG)
    deadline = time.monotonic() + settle
    while True:
        try:
            rules, notes = ruleset(config)
        except (ValueError, CollectError) as exc:  # a config file that no longer parses
            rules, notes = {"rendered": f"unreadable: {exc}", "loaded": UNREADABLE}, []
        if rules["loaded"] == AS_RENDERED or time.monotonic() >= deadline:
            break
        time.sleep(1)
    try:
        appliance_policy = policy(config)
    except ValueError as exc:
        appliance_policy = {"appliance": f"unreadable: {exc}"}
    appliance = appliance_values(root, name)
    manifest = build(
        corral={"version": metadata.version("corral"), "commit": commit},
        packages=packages(), wheels=wheels(venv, wheel_dir, lock), images=images(root),
        files=files(root, {k: v for k, v in appliance.items() if k in MASKED}),
        units=units(root), ruleset=rules, policy=appliance_policy, appliance=appliance)
    return manifest, notes
