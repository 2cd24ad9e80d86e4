"""`corral certs`: the control plane's certificates (rotated on this host) and the filter's
interception CA (shown, rotated and handed to sessions again through the API)."""

from __future__ import annotations

import os
import signal

from appliance import pki

from . import exitcodes, output
from .client import CliError, load_appliance
from .targets import client_for


def cmd_certs_interception(args) -> int:
    """The filter's interception CA: what sessions trust for the hosts it inspects."""
    client = client_for(args)
    if args.refresh:
        answer = client.request("POST", "/certs/interception/refresh", {})
        if args.json:
            output.data(answer)
        elif answer["sessions"] is not None:
            output.line(f"given the CA again: {', '.join(answer['sessions']) or 'no session'}")
        if answer["failed"]:
            raise CliError("not given the CA: " + "; ".join(
                f"{name}: {why}" for name, why in answer["failed"].items()))
        return exitcodes.OK
    answer = client.request("GET", "/certs/interception")
    ca = answer.get("ca")
    if args.json:
        output.data(answer)
    elif ca is None:
        output.line("inspection is off: the filter has no interception CA (set [inspect] "
                    "ca_dir in its config, as the roles do)")
    elif args.pem:
        output.line(ca["pem"].rstrip("\n"))
    else:
        _show_ca(ca)
    return exitcodes.OK


def _show_ca(ca: dict) -> None:
    output.line(f"interception CA  {ca['subject']}\n"
                f"sha256           {ca['sha256']}\n"
                f"valid            {ca['not_before']} to {ca['not_after']} "
                f"({ca['days_left']} days left)\n"
                "rotate           " + ("`corral certs rotate --interception`" if ca["rotatable"]
                                       else "given as files ([inspect] ca_cert): by hand"))


def cmd_certs_rotate(args) -> int:
    """A new CA, server and client certificate; the old client certificate stops working.
    With --interception: a new interception CA instead, trusted by every running session."""
    if args.interception:
        answer = client_for(args).request("POST", "/certs/interception/rotate", {})
        if args.json:
            output.data(answer)
            return exitcodes.OK
        _show_ca(answer["ca"])
        sessions = answer["sessions"]
        output.line(f"rotated: the filter signs with the new CA now (was {answer['previous']})"
                    + ("" if sessions is None else f"; {len(sessions)} running session(s) "
                       f"given it: {', '.join(sessions) or 'none'}") + ". Processes started "
                    "before in a session (a running node, a JVM) keep the old one: restart "
                    "them")
        if answer["failed"]:
            raise CliError("not given the new CA: " + "; ".join(
                f"{name}: {why}" for name, why in answer["failed"].items()),
                "fix that, then `corral certs interception --refresh`")
        return exitcodes.OK
    appliance = load_appliance(args.appliance)
    if appliance.server_dir is None:
        raise CliError(f"appliance {appliance.name} does not run on this host",
                       "rotate a VM appliance's certificates by re-provisioning it "
                       "(playbooks/rotate-certs.yml)", exitcodes.USAGE)
    host = appliance.host_port[0]
    bundle = pki.issue([host] if host[:1].isdigit() or ":" in host else ["127.0.0.1"],
                       [] if host[:1].isdigit() or ":" in host else [host])
    pki.write_server(bundle, appliance.server_dir)
    pki.write_client(bundle, appliance.directory)
    if appliance.api_pidfile:
        try:
            os.kill(int(appliance.api_pidfile.read_text().split()[0]), signal.SIGHUP)
        except (OSError, ValueError, IndexError) as exc:
            raise CliError(f"new certificates written, but the API could not be told to load "
                           f"them ({appliance.api_pidfile}: {exc})",
                           "restart corral-api: it loads them when it starts") from None
    output.line(f"rotated: new CA and certificates for {appliance.name}; the API reloads them, "
                "and the previous client certificate no longer works")
    return exitcodes.OK


def register(sub) -> None:
    certs = sub.add_parser("certs", help="the control plane's certificates, and the "
                           "interception CA")
    certs_sub = certs.add_subparsers(dest="certs_command", required=True, metavar="COMMAND")
    rotate = certs_sub.add_parser(
        "rotate", help="issue a new CA and certificates; the old client certificate stops "
        "working (--interception: a new interception CA instead)",
        description="Without options: a new control-plane CA, server and client certificate "
        "for an appliance on this host; the old client certificate stops working. With "
        "--interception: the filter makes a new interception CA and signs inspected hosts' "
        "certificates with it at once; every running session is given it to trust.")
    rotate.add_argument("--appliance", default="default", metavar="NAME")
    rotate.add_argument("--interception", action="store_true",
                        help="rotate the interception CA (any appliance, through its API)")
    rotate.add_argument("--json", action="store_true", help="machine-readable output")
    rotate.set_defaults(run=cmd_certs_rotate)
    shown = certs_sub.add_parser(
        "interception", help="the interception CA sessions trust for inspected hosts",
        description="The filter's interception CA: subject, SHA-256 fingerprint, validity; "
        "--pem prints the certificate (to trust it outside a session).")
    shown.add_argument("--appliance", default="default", metavar="NAME")
    shown.add_argument("--pem", action="store_true", help="print the certificate (PEM)")
    shown.add_argument("--refresh", action="store_true", help="give every running session "
                       "the CA again (after a rotation that could not reach one)")
    shown.add_argument("--json", action="store_true", help="machine-readable output")
    shown.set_defaults(run=cmd_certs_interception)
