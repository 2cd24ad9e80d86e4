"""What a command acts on: the appliance (--appliance), the session (--session, or the only
one there is) and the project directory on this host (with the id a session records of the
project it was started from). Shared by the command modules, which import nothing from each
other for these."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from . import exitcodes
from .client import Client, CliError, load_appliance


def client_for(args) -> Client:
    return Client(load_appliance(args.appliance))


def pick_session(client: Client, given: str | None) -> str:
    """The named session, or the only one there is."""
    if given:
        return given
    names = [s["name"] for s in client.request("GET", "/sessions")["sessions"]]
    if len(names) == 1:
        return names[0]
    raise CliError("which session? " + (f"there are {len(names)}: {', '.join(names)}" if names
                                         else "there are none"),
                   "pass --session NAME" if names else "start one with `corral run`",
                   exitcodes.USAGE)


def project_id(project: Path) -> str:
    """Stable per project directory: its name (readable) and a hash of its path (unique)."""
    stem = re.sub(r"[^a-z0-9-]+", "-", project.name.lower()).strip("-")[:23] or "project"
    return f"{stem}-{hashlib.sha256(str(project).encode()).hexdigest()[:8]}"


def project_of(client, session: str, project_dir: str | None, force: bool) -> Path:
    """The project directory whose corral.toml a session's rules go into: --project or the
    current directory, which must be the one the session was started from. When that is
    not known (a session from the appliance's own config, or the sandbox service did not
    answer), only an explicit --project (or --force) says which."""
    project = Path(project_dir or ".").resolve()
    if not project.is_dir():
        raise CliError(f"no project directory {project}", code=exitcodes.USAGE)
    started = client.request("GET", f"/sessions/{session}").get("project")
    if force:
        return project
    if started and started != project_id(project):
        raise CliError(f"session {session} was started from another project ({started}), "
                       f"not {project}", "run it in that project, pass --project DIR, or "
                       "--force", exitcodes.USAGE)
    if not started and project_dir is None:
        raise CliError(f"which project session {session} came from is not known",
                       "name it: --project DIR", exitcodes.USAGE)
    return project
