"""The only code that runs podman: argument lists, no shell, machine-readable output,
and a non-zero exit is always an error that carries podman's own words."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path


class PodmanError(RuntimeError):
    """podman failed; the message is the command and what podman said."""


class Podman:
    def __init__(self, containers_conf: Path | None = None, executable: str = "podman"):
        self.executable = executable
        self.env = dict(os.environ)
        if containers_conf is not None:
            self.env["CONTAINERS_CONF"] = str(containers_conf)

    def run(self, *args: str, timeout: float = 600, input: bytes | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        command = [self.executable, *args]
        try:
            result = subprocess.run(command, capture_output=True, timeout=timeout, env=self.env,
                                    input=input)
        except FileNotFoundError:
            raise PodmanError("podman is not installed: apt-get install podman runc netavark "
                              "aardvark-dns catatonit uidmap") from None
        except subprocess.TimeoutExpired:
            raise PodmanError(f"{' '.join(command[:4])}... did not finish in {timeout:.0f}s"
                              ) from None
        if check and result.returncode != 0:
            said = result.stderr.decode(errors="replace").strip() or result.stdout.decode(
                errors="replace").strip()
            raise PodmanError(f"{' '.join(command[:6])}{' ...' if len(command) > 6 else ''}: "
                              f"exit {result.returncode}: {said}")
        return result

    def json(self, *args: str) -> object:
        return json.loads(self.run(*args).stdout or b"null")

    def image_exists(self, reference: str) -> bool:
        return self.run("image", "exists", reference, check=False).returncode == 0
