"""The sandbox image, from Debian packages only: no registry, no third-party image to trust.

  mmdebstrap (trixie, PACKAGES) -> rootfs.tar -> `podman import` -> corral-base:VERSION
  + the layer in CONTAINERFILE (the selftest, corral-request, /work, labels)
                                                               -> corral-sandbox:VERSION

The selftest (appliance/selftest/, a package) goes in as one file: a zipapp of the package
behind a `#!/usr/bin/python3` line, built here the same, byte for byte, from the same sources.

The package list lives here and nowhere else; change it (or the layer) and bump VERSION.
A team layers its own tools on top with a Containerfile that starts
`FROM localhost/corral-sandbox:<VERSION>` (see docs/sandboxes.md).
"""

from __future__ import annotations

import hashlib
import io
import shutil
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from .podman import Podman, PodmanError

VERSION = "2"
SUITE = "trixie"
PACKAGES = (
    "ca-certificates", "git", "curl", "less", "jq", "ripgrep", "openssh-client",
    "python3", "python3-venv", "python3-pip", "nodejs", "npm", "build-essential",
    "catatonit",
)
BASE = f"localhost/corral-base:{VERSION}"
IMAGE = f"localhost/corral-sandbox:{VERSION}"
SELFTEST = Path(__file__).resolve().parents[1] / "selftest"
"""The battery's package: every .py file under it is shipped, and digested."""
SELFTEST_INTERPRETER = b"#!/usr/bin/python3\n"  # Debian's, in the base image
SELFTEST_MAIN = b"import sys\n\nfrom selftest.cli import main\n\nsys.exit(main())\n"
"""The zipapp's own __main__.py: the package sits in the archive as `selftest`."""
REQUEST = Path(__file__).resolve().with_name("corral_request.py")
"""`corral-request`: an agent asks a person for a host (one file, standard library only)."""

CONTAINERFILE = """\
FROM {base}
COPY corral-selftest corral-request /usr/local/bin/
RUN chmod 0755 /usr/local/bin/corral-selftest /usr/local/bin/corral-request \\
 && mkdir -p /work /home/agent /etc/corral/trust && chmod 1777 /work /home/agent \\
 && cp /etc/ssl/certs/ca-certificates.crt /etc/corral/trust/ca-bundle.crt \\
 && ln -sf /etc/corral/trust/ca-bundle.crt /etc/ssl/certs/ca-certificates.crt
LABEL io.corral.image="sandbox" io.corral.version="{version}" \\
      io.corral.packages="{packages}" io.corral.layer="{digest}"
WORKDIR /work
CMD ["/bin/bash", "-l"]
"""


def selftest_zipapp(package: Path = SELFTEST) -> bytes:
    """`corral-selftest`: the battery's package as one executable file (a zipapp, as
    `python -m zipapp` makes). The same sources give the same bytes: entries sorted, stored
    uncompressed, with a fixed time and mode, so the digest changes only when a file does."""
    buffer = io.BytesIO()
    buffer.write(SELFTEST_INTERPRETER)
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        entries = [("__main__.py", SELFTEST_MAIN)] + [
            (f"selftest/{path.relative_to(package).as_posix()}", path.read_bytes())
            for path in sorted(package.rglob("*.py"))]
        for name, data in entries:
            entry = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            entry.external_attr = 0o644 << 16
            archive.writestr(entry, data)
    return buffer.getvalue()


def request_script() -> bytes:
    return SELFTEST_INTERPRETER + REQUEST.read_bytes()


def layer_digest(package: Path = SELFTEST) -> str:
    """What the top layer is made of: the Containerfile and the files it copies in (the
    selftest's zipapp, so every file of the package, and corral-request)."""
    return _digest(selftest_zipapp(package), request_script())


def _digest(selftest: bytes, request: bytes) -> str:
    digest = hashlib.sha256(CONTAINERFILE.encode())
    digest.update(selftest)
    digest.update(hashlib.sha256(request).digest())
    return digest.hexdigest()[:16]


def _current(podman: Podman) -> bool:
    if not podman.image_exists(IMAGE):
        return False
    labels = podman.json("image", "inspect", IMAGE)[0].get("Labels") or {}
    return labels.get("io.corral.layer") == layer_digest()


def build(podman: Podman, mirror: str = "http://deb.debian.org/debian",
          progress: Callable[[str], None] = print, rebuild: bool = False) -> str:
    """Build the sandbox image, or keep it when it is current; returns its reference.
    The slow base (packages) is rebuilt only when VERSION changes or `rebuild` says so; the
    layer whenever its inputs (the selftest included) change. Raises PodmanError."""
    if not rebuild and _current(podman):
        progress(f"image {IMAGE} is current")
        return IMAGE
    if shutil.which("mmdebstrap") is None:
        raise PodmanError("mmdebstrap is not installed: apt-get install mmdebstrap")
    with tempfile.TemporaryDirectory(prefix="corral-image-") as tmp:
        work = Path(tmp)
        started = time.monotonic()
        if rebuild or not podman.image_exists(BASE):
            progress(f"[1/3] mmdebstrap {SUITE} with {len(PACKAGES)} packages ...")
            _mmdebstrap(work / "rootfs.tar", mirror)
            progress(f"[2/3] podman import -> {BASE} ({time.monotonic() - started:.0f}s)")
            podman.run("import", "--change", 'CMD ["/bin/bash"]', str(work / "rootfs.tar"),
                       BASE)
        else:
            progress(f"[1-2/3] {BASE} is there (same package list): only the layer is built")
        progress(f"[3/3] podman build -> {IMAGE} ({time.monotonic() - started:.0f}s)")
        selftest = selftest_zipapp()  # once: the label names exactly what is copied in
        request = request_script()
        (work / "corral-selftest").write_bytes(selftest)
        (work / "corral-request").write_bytes(request)
        (work / "Containerfile").write_text(CONTAINERFILE.format(
            base=BASE, version=VERSION, packages=" ".join(PACKAGES),
            digest=_digest(selftest, request)))
        podman.run("build", "--network", "none", "--tag", IMAGE, "--file",
                   str(work / "Containerfile"), str(work))
        progress(f"built {IMAGE} in {time.monotonic() - started:.0f}s")
    return IMAGE


def _mmdebstrap(target: Path, mirror: str) -> None:
    import subprocess

    command = [
        "mmdebstrap", "--quiet", "--variant=apt", f"--include={','.join(PACKAGES)}",
        "--aptopt=Acquire::Retries \"3\"",  # a mirror hiccup should not fail the build
        # documentation and translations are not what an agent needs; they are a third
        "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
        "--dpkgopt=path-exclude=/usr/share/locale/*",
        SUITE, str(target), mirror,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    if result.returncode != 0:
        raise PodmanError(f"mmdebstrap failed (exit {result.returncode}): "
                          f"{result.stderr.strip()[-2000:]}")
