"""What `corral run` is about to copy into a session, read for secrets first: a session is
where an agent works at full autonomy, and whatever enters it can leave through any host
the policy allows. A finding (path, line, detector; never the value) stops the run unless
the file is excluded from the copy (`[workspace] exclude` in corral.toml) or the user says
`--allow-secrets`.

The detectors are detect-secrets' (Yelp's maintained library: one plugin per credential
format, each with its own verification of the shape), limited to the formats that are
secrets by their shape alone: the entropy and keyword plugins are left out, since every
lock file and test fixture would stop a run; its filters stay (`# pragma: allowlist
secret` marks a line as known). One finding of our own: a `.env`-style file with an
assignment in it (`.env`, `.env.local`, `prod.env`, `.envrc`; not `.env.example`). Not
read: files over MAX_FILE and under dependency directories (UNREAD_NAMES; both counted and
said), what detect-secrets cannot read as text (binaries, other encodings), `.git/objects`
(compressed: history is copied unread).
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass
from pathlib import Path

PLUGINS = (
    "AWSKeyDetector", "ArtifactoryDetector", "AzureStorageKeyDetector", "BasicAuthDetector",
    "CloudantDetector", "DiscordBotTokenDetector", "GitHubTokenDetector",
    "GitLabTokenDetector", "JwtTokenDetector", "MailchimpDetector", "NpmDetector",
    "OpenAIDetector", "PrivateKeyDetector", "PypiTokenDetector", "SendGridDetector",
    "SlackDetector", "SquareOAuthDetector", "StripeDetector", "TelegramBotTokenDetector",
    "TwilioKeyDetector",
)
"""detect-secrets plugins whose findings are credentials by their shape alone."""
MAX_FILE = 2 << 20
"""Files larger than this are not read (their count is reported)."""
SKIPPED_DIRS = (".git/objects", ".git/lfs")
"""Compressed or content-addressed: nothing readable (`.git/config` is read: a remote URL
with a token in it is a classic leak)."""
UNREAD_NAMES = frozenset({"node_modules", ".venv", "venv", "__pycache__", ".tox", ".nox",
                          ".mypy_cache", ".pytest_cache", ".ruff_cache"})
"""Directories of installed dependencies and caches, at any depth: copied, not read (tens of
thousands of files written by package managers, minutes of reading for nothing of the
project's own; their count is reported)."""
_DOTENV = re.compile(r"(?:^\.env(?:\..+|rc)?|.+\.env)$")
_DOTENV_SAMPLE = re.compile(r"\.(?:example|sample|template|dist|defaults?)$")
_ASSIGNMENT = re.compile(r"^\s*(?:export\s+)?[A-Za-z_][A-Za-z0-9_]*\s*=\s*\S")


class ScanUnavailable(RuntimeError):
    """detect-secrets is not installed: the scan cannot run (and `run` refuses)."""


@dataclass(frozen=True, slots=True)
class Finding:
    path: str
    """Relative to the project, '/'-separated."""
    line: int
    detector: str

    def to_json(self) -> dict:
        return {"path": self.path, "line": self.line, "detector": self.detector}


@dataclass(slots=True)
class Report:
    findings: list[Finding]
    files: int = 0
    too_large: int = 0
    unread: int = 0
    """Files under dependency and cache directories (UNREAD_NAMES)."""


def excluded(relative: str, patterns: tuple[str, ...]) -> bool:
    """Does a `[workspace] exclude` pattern cover this path (or a directory above it)?
    Patterns are globs relative to the project (`secrets/`, `*.pem`, `config/prod.env`); a
    pattern without '/' matches a name at any depth."""
    parts = relative.split("/")
    for pattern in patterns:
        pattern = pattern.strip("/")
        if "/" in pattern:
            candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        else:
            candidates = parts
        if any(fnmatch.fnmatchcase(c, pattern) for c in candidates):
            return True
    return False


def files(project: Path, patterns: tuple[str, ...], always: tuple[str, ...]):
    """(relative path, path) of every regular file `corral run` copies."""
    for root, dirs, names in os.walk(project):
        here = Path(root)
        rel_root = here.relative_to(project).as_posix()
        rel_root = "" if rel_root == "." else rel_root + "/"
        dirs[:] = sorted(d for d in dirs if not excluded(rel_root + d, patterns)
                         and (rel_root + d) not in always and not (here / d).is_symlink())
        for name in sorted(names):
            relative = rel_root + name
            path = here / name
            if excluded(relative, patterns) or path.is_symlink() or not path.is_file():
                continue
            yield relative, path


def scan(project: Path, patterns: tuple[str, ...] = (), always: tuple[str, ...] = ()
         ) -> Report:
    """Read every file the copy takes for secrets. Raises ScanUnavailable without
    detect-secrets."""
    try:
        from detect_secrets import SecretsCollection
        from detect_secrets.settings import transient_settings
    except ImportError:
        raise ScanUnavailable("reading the project for secrets needs detect-secrets") from None
    report = Report([])
    readable: list[tuple[str, Path]] = []
    for relative, path in files(project, patterns, always):
        if any(relative.startswith(d + "/") for d in SKIPPED_DIRS):
            continue
        report.files += 1
        if UNREAD_NAMES.intersection(relative.split("/")[:-1]):
            report.unread += 1
            continue
        try:
            size = path.stat().st_size
        except OSError:  # gone meanwhile: nothing to copy either
            continue
        if size > MAX_FILE:
            report.too_large += 1
            continue
        readable.append((relative, path))
        if _DOTENV.match(path.name) and not _DOTENV_SAMPLE.search(path.name):
            report.findings += _dotenv(relative, path)
    # detect-secrets' own filters stay: `# pragma: allowlist secret` on a line, lock files,
    # templated and indirect values
    settings = {"plugins_used": [{"name": name} for name in PLUGINS]}
    with transient_settings(settings):
        collection = SecretsCollection(root=str(project))
        if readable:  # one process per core: detect-secrets reads line by line, in Python
            collection.scan_files(*(relative for relative, _ in readable))
        for relative, secrets in collection.data.items():
            report.findings += [Finding(relative, s.line_number, s.type) for s in secrets]
    report.findings.sort(key=lambda f: (f.path, f.line, f.detector))
    return report


def _dotenv(relative: str, path: Path) -> list[Finding]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [Finding(relative, number, "assignment in a .env file")
            for number, line in enumerate(lines, 1) if _ASSIGNMENT.match(line)]
