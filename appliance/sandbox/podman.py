"""The only code that runs podman: argument lists, no shell, machine-readable output,
and a non-zero exit is always an error that carries podman's own words."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path


class PodmanError(RuntimeError):
    """podman failed; the message is the command and what podman said."""


class Podman:
    def __init__(self, containers_conf: Path | None = None, executable: str = "podman",
                 prefix: tuple[str, ...] = ()):
        self.executable = executable
        self.prefix = prefix
        """Run podman under this, e.g. `nsenter --net=/run/netns/X` to make another network
        namespace podman's host (tests do; `ip netns exec` would hide the cgroup mounts)."""
        self.env = dict(os.environ)
        if containers_conf is not None:
            self.env["CONTAINERS_CONF"] = str(containers_conf)

    def run(self, *args: str, timeout: float = 600, input: bytes | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        command = [*self.prefix, self.executable, *args]
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

    def remove_container(self, name: str, attempts: int = 10) -> None:
        """Stop, then remove. podman 4.3 (Debian 12) can fail the removal with EBUSY on the
        container's shm mount while conmon is still exiting (podman#11594, fixed after 4.3
        by podman PR #16159): only that error is retried, briefly."""
        self.run("stop", "--ignore", "--time", "0", name)
        for attempt in range(attempts):
            try:
                self.run("rm", "--force", "--ignore", "--time", "0", name)
                return
            except PodmanError as exc:
                if "device or resource busy" not in str(exc) or attempt == attempts - 1:
                    raise
                time.sleep(0.2)

    def image_exists(self, reference: str) -> bool:
        return self.run("image", "exists", reference, check=False).returncode == 0
