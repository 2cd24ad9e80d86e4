"""corral selftest: try to escape the sandbox in every way THREATS.md lists; expect to fail.

Runs inside a sandbox, standard library only: the image carries this package as one file, a
zipapp at /usr/local/bin/corral-selftest (appliance/sandbox/image.py builds it); from a
checkout, `python -m appliance.selftest`. Nothing here imports the rest of `appliance`.
Each probe is a module-level function registered with `@probe(id, threat, ...)`; it returns
an Outcome, and passes only if the attempt failed, fast (no hang), the way corral promises:
NXDOMAIN, 403 with a reason, a TLS alert, a reset, an ICMP error, EPERM. Next to the
attacks, the legitimate flows the policy allows must keep working.

Every probe ends in one of three states: passed, failed, or not run (it could not even be
tried: no ICMP socket for this user, no libc, a read-only workspace). A probe that could not
run is never reported as passed, and the exit status is 0 only when every selected probe
passed. Groups: `network` (the filter and the firewall), `kernel` (system calls a sandbox
must be refused; meaningful only inside a real session), `review` (files the session's diff
must survive). `--skip-group` deselects a group, and the summary says so.

The sandbox cannot see whether a denial was recorded (it has no access to the control
plane, by design); with --json each probe says which event or counter should show it
(`expect`), and the appliance checks that (appliance/sandbox/battery.py): `corral selftest`,
verify.yml and the e2e suite all go through that check.

  registry    Probe, the registry and `@probe`, the states, selection, the runner
  wire        DNS, TCP, HTTP, TLS and CONNECT helpers; the Context a probe gets
  network     legitimate flows, then T1-T11, T13, T18, T33
  smuggling   T20: request smuggling on a shared IP
  inspection  T13, T24 on a host the session inspects (--inspected); T25 over SSH
              through the git gateway (--git-ssh)
  readings    T14, T27, T28, T30 on --inspected: a request the origin reads another way
              (overrides, a fake 101, encoded bodies, a value the agent came to hold)
  approvals   T15, T21 in a session in ask mode (--ask-hold; run apart, with --only)
  starvation  T21: starving the neighbours (runs last of the network group)
  kernel      T22: system calls refused, each tried in a child process
  review      T23: files the diff must survive
  cli         arguments, output, exit status (`__main__` runs it)
"""

import importlib

PROBE_MODULES = ("network", "smuggling", "inspection", "readings", "approvals", "starvation",
                 "kernel", "review")
"""Imported in this order, which is the order the probes register in, run in and are listed
in (`--list`, the --json lines)."""

for _module in PROBE_MODULES:
    importlib.import_module(f".{_module}", __name__)
