"""`corral image build`: the sandbox image, built on the appliance by its sandbox service's
own command (run with the words the appliance.toml gives: directly, or over SSH to a VM)."""

from __future__ import annotations

import subprocess

from . import exitcodes
from .client import CliError, load_appliance


def cmd_image_build(args) -> int:
    appliance = load_appliance(args.appliance)
    argv = [*appliance.sandbox, "image", "build", *(["--rebuild"] if args.rebuild else [])]
    if appliance.state_dir:
        argv += ["--config", str(appliance.state_dir / "sandbox.toml")]
    elif appliance.backend == "vm":  # where corral_sandbox writes it
        argv += ["--config", "/etc/corral/sandbox.toml"]
    code = subprocess.call(argv)
    if code != 0:
        raise CliError(f"the image build failed (exit {code})", "see its output above")
    return exitcodes.OK


def register(sub) -> None:
    image = sub.add_parser("image", help="the sandbox image")
    image_sub = image.add_subparsers(dest="image_command", required=True, metavar="COMMAND")
    build = image_sub.add_parser("build", help="build the sandbox image on the appliance "
                                 "(keeps it when current)")
    build.add_argument("--appliance", default="default", metavar="NAME")
    build.add_argument("--rebuild", action="store_true", help="rebuild the Debian base too")
    build.set_defaults(run=cmd_image_build)
