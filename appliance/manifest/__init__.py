"""The appliance's manifest: what provisioning made it, as data, and how two manifests differ.

Pure and standard library only (the CLI compares two appliances' manifests with it); the
collector that reads a running appliance is `collect.py`, run as root on the appliance
(`python -m appliance.manifest collect|check|write`).

A manifest is a JSON object of sections, each a mapping from a name to a value (docs/
appliance.md lists them):

  corral     version, commit       packages  Debian package -> "version arch"
  wheels     distribution in the venv -> {version, sha256 of its installed files[, locked]}
  images     podman image -> its id      files   path -> sha256 (appliance values masked)
  units      corral unit -> "enabled-state active-state"
  ruleset    rendered -> sha256 of the sessionless ruleset nft loads; loaded -> "as rendered"
  policy     appliance -> sha256 of the effective appliance policy
  appliance  what differs between appliances by design: name, hostname, host gateway

Nothing in it changes by itself: no times, no pids, no sessions' set elements, so that a
second provisioning writes the same bytes and drift is a difference by name. `appliance` is
compared on one appliance (its manifest against itself running) and set apart as expected
to differ between two (`corral verify --against`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

FORMAT = 1
"""The manifest's format; a manifest of another format is not compared, it is refused."""

SECTIONS = {
    "corral": "corral",
    "packages": "package",
    "wheels": "wheel",
    "images": "image",
    "files": "file",
    "units": "unit",
    "ruleset": "ruleset",
    "policy": "policy",
    "appliance": "appliance",
}
"""Each section and the word a difference in it starts with (`package nftables: ...`)."""

APPLIANCE_SPECIFIC = "appliance"
"""The section that differs between two appliances from one commit by design."""

AS_RENDERED = "as rendered"
"""ruleset.loaded when the loaded corral table is the one the configuration renders."""


class ManifestError(ValueError):
    """A manifest that cannot be compared: not JSON, not an object, another format."""


@dataclass(frozen=True)
class Difference:
    section: str
    """Which section: packages, files, ..."""
    name: str
    """The package, file, unit ... that differs."""
    before: object
    """Its value in the first (recorded) manifest; None: it was not there."""
    after: object
    """Its value in the second (running, or other appliance's); None: it is not there."""

    def __str__(self) -> str:
        word = SECTIONS.get(self.section, self.section)
        if self.section == "ruleset" and self.name == "loaded":
            return f"ruleset: loaded {self.after or 'missing'}" if self.before == AS_RENDERED \
                else f"ruleset loaded: {_show(self.before)} -> {_show(self.after)}"
        label = f"{word} {self.name}"
        if self.before is None:
            return f"{label}: added ({_show(self.after)})"
        if self.after is None:
            return f"{label}: removed (was {_show(self.before)})"
        return f"{label}: {_show(self.before)} -> {_show(self.after)}"

    def to_json(self) -> dict:
        return {"section": self.section, "name": self.name, "before": self.before,
                "after": self.after, "text": str(self)}


@dataclass(frozen=True)
class Comparison:
    differences: tuple[Difference, ...]
    """What differs and should not."""
    expected: tuple[Difference, ...] = ()
    """What differs between two appliances by design (their `appliance` section)."""

    def to_json(self) -> dict:
        return {"identical": not self.differences,
                "differences": [d.to_json() for d in self.differences],
                "expected_to_differ": [d.to_json() for d in self.expected]}


def _show(value) -> str:
    """A value as a difference line shows it: hashes shortened to 12 hex digits."""
    if isinstance(value, dict):  # a wheel: its version bare, each other field named
        return " ".join(str(v) if k == "version" else f"{k} {_short(v)}"
                        for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(_show(v) for v in value)
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return f"sha256 {_short(value)}"
    return str(value)


def _short(digest) -> str:
    return f"{digest[:12]}…" if isinstance(digest, str) and len(digest) > 12 else str(digest)


def sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def digest_json(value) -> str:
    """The sha256 of a JSON value in its canonical form (sorted keys, no spaces)."""
    return sha256(json.dumps(value, sort_keys=True, separators=(",", ":")))


def build(*, corral: dict, packages: dict, wheels: dict, images: dict, files: dict,
          units: dict, ruleset: dict, policy: dict, appliance: dict) -> dict:
    """A manifest from collected facts, every section sorted by name."""
    sections = {"corral": corral, "packages": packages, "wheels": wheels, "images": images,
                "files": files, "units": units, "ruleset": ruleset, "policy": policy,
                "appliance": appliance}
    return {"format": FORMAT, **{k: dict(sorted(v.items())) for k, v in sections.items()}}


def dumps(manifest: dict) -> bytes:
    """The manifest's bytes: the same manifest always gives the same bytes."""
    return (json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode()


def loads(data: bytes | str, where: str = "the manifest") -> dict:
    try:
        manifest = json.loads(data)
    except ValueError as exc:
        raise ManifestError(f"{where}: not JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise ManifestError(f"{where}: not a JSON object")
    if manifest.get("format") != FORMAT:
        raise ManifestError(f"{where}: format {manifest.get('format')!r}, this corral reads "
                            f"format {FORMAT}: provision it again (site.yml writes it)")
    for section in SECTIONS:
        if not isinstance(manifest.get(section, {}), dict):
            raise ManifestError(f"{where}: {section} is not an object")
    return manifest


def compare(first: dict, second: dict, *, across: bool = False,
            sections: tuple[str, ...] = tuple(SECTIONS)) -> Comparison:
    """Every difference between two manifests, by section and name.

    `across`: the two are different appliances, so their `appliance` sections are expected
    to differ (set apart); otherwise the second is the first's appliance running now, and
    a difference there is drift like any other. `sections`: only these (a box's package
    set against an appliance's: `("packages",)`)."""
    found, expected = [], []
    for section in sections:
        before, after = first.get(section, {}), second.get(section, {})
        for name in sorted(set(before) | set(after)):
            if before.get(name) != after.get(name):
                difference = Difference(section, name, before.get(name), after.get(name))
                (expected if across and section == APPLIANCE_SPECIFIC else found).append(
                    difference)
    return Comparison(tuple(found), tuple(expected))


DPKG_FORMAT = "${Package} ${Version} ${Architecture}\n"
"""dpkg-query's output format for `parse_dpkg`."""


def dpkg_query(admindir: str | None = None) -> list[str]:
    """The dpkg-query command line whose output `parse_dpkg` reads; `admindir`: another
    system's dpkg database (a box's tree: `ROOT/var/lib/dpkg`)."""
    return ["dpkg-query", *([f"--admindir={admindir}"] if admindir else []), "-W",
            "-f", DPKG_FORMAT]


def box_manifest(dpkg_output: str, images: dict[str, str] | None = None) -> dict:
    """A manifest of a box: its package set and the sandbox images baked in (`corral box
    build` records it beside the box and inside it): `compare(box, appliance,
    sections=("packages",))` then names what provisioning installed, upgraded or removed on
    top of the box."""
    return build(corral={}, packages=parse_dpkg(dpkg_output), wheels={}, images=images or {},
                 files={}, units={}, ruleset={}, policy={}, appliance={})


def parse_dpkg(text: str) -> dict[str, str]:
    """`dpkg-query -W -f '${Package} ${Version} ${Architecture}\\n'` -> package -> "version
    arch". A package known to dpkg but not installed has no version: it is left out."""
    packages = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 3:
            packages[fields[0]] = f"{fields[1]} {fields[2]}"
    return packages


def parse_lock(text: str) -> dict[str, dict]:
    """A hashed requirements file (pip-compile --generate-hashes, `uv pip compile`) ->
    normalised name -> {version, hashes}: what the appliance's wheels were locked to."""
    locked, logical = {}, ""
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        logical += " " + line.rstrip("\\").strip()
        if line.endswith("\\"):
            continue
        words, logical = logical.split(), ""
        if not words or "==" not in words[0]:
            continue
        name, _, version = words[0].partition("==")
        name = normalise_name(name.split("[")[0].split(";")[0])
        hashes = sorted(w.removeprefix("--hash=") for w in words[1:] if w.startswith("--hash="))
        locked[name] = {"version": version.split(";")[0].strip(), "hashes": hashes}
    return locked


def normalise_name(name: str) -> str:
    """A distribution's name as PEP 503 compares them."""
    return "-".join(name.replace("_", "-").replace(".", "-").lower().split("-"))


def mask(data: bytes, values: dict[str, str]) -> bytes:
    """A file's bytes with each appliance-specific value replaced by its name, so that the
    same configuration on two appliances hashes the same (the values themselves are in the
    manifest's `appliance` section)."""
    for name, value in sorted(values.items(), key=lambda item: -len(item[1] or "")):
        if value:
            data = data.replace(value.encode(), f"{{appliance.{name}}}".encode())
    return data
