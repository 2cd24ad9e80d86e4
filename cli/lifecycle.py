"""`corral up` and `corral down`: an appliance brought up and stopped, by its backend: a VM
(vm.py, the default) or the services on this Linux host (local.py)."""

from __future__ import annotations

from . import exitcodes, local, vm
from .arguments import appliance_name, machine_command, vm_timeout
from .client import CliError, load_appliance


def cmd_up(args) -> int:
    if args.backend == "local":
        if args.trust_ca:
            raise CliError("--trust-ca is for a VM: a local appliance trusts this host's store",
                           "add the CA to this host's store (update-ca-certificates)",
                           exitcodes.USAGE)
        return local.up(args)
    return vm.up(args)


def cmd_down(args) -> int:
    # (a VM booted with --no-provision has no credentials yet, and stops all the same)
    if load_appliance(args.appliance, need_credentials=False).backend == "local":
        return local.down(args)
    return vm.halt(args)


def register(sub) -> None:
    up = sub.add_parser("up", help="bring an appliance up (a VM by default)",
                        description="Bring an appliance up. The VM backend (default): check "
                        "prerequisites, build the box if missing (`corral box build`), "
                        "`vagrant up` with libvirt, provision it with playbooks/site.yml and "
                        "wait for the API. --backend local runs the services on this Linux "
                        "host (root) instead, supervised, with state and logs in --state-dir.")
    up.add_argument("--backend", choices=["vm", "local"], default="vm")
    up.add_argument("--name", default="default", type=appliance_name,
                    help="the appliance's name for --appliance")
    up.add_argument("--api-port", type=int, default=8443, metavar="PORT",
                    help="vm: the host's 127.0.0.1 port the API is forwarded to")
    up.add_argument("--trust-ca", action="append", metavar="FILE",
                    help="vm: a CA certificate (PEM) the appliance trusts besides Debian's "
                    "store, for a network that ends TLS with its own CA (the filter verifies "
                    "inspected hosts against it); repeatable, recorded for `corral provision`")
    up.add_argument("--state-dir", default=str(local.DEFAULT_STATE), metavar="DIR",
                    help="local: where config, state and logs live")
    up.add_argument("--upstream", action="append", metavar="IP:PORT",
                    help="local: the filter's upstream resolvers (default: the host's)")
    up.add_argument("--api-listen", default="127.0.0.1:7443", metavar="IP:PORT", help="local")
    up.add_argument("--no-image", action="store_true",
                    help="local: do not build the sandbox image")
    up.add_argument("--no-provision", action="store_true",
                    help="vm: only boot the VM from the box; provision it (with others) from "
                    "an inventory: `ansible-playbook -i INVENTORY playbooks/site.yml`")
    vm_timeout(up)
    up.set_defaults(run=cmd_up)

    machine_command(sub, "down", "stop an appliance: the VM halts (local backend: sessions, "
                    "services, then the ruleset stop)", cmd_down)
