"""Files the CLI writes whole: a reader (another `corral`, a person, a script) sees the old
file or the new one, never half of either."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def replace(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write `data` to `path` atomically, with `mode` set before it is visible."""
    path = Path(path)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.resolve().parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), mode)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
