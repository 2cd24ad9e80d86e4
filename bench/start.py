"""The session start row: how long `corral run --detach` takes, and then the first
`corral shell -- true` in the new session, on the local backend, as a person runs them.

The appliance is `corral up --backend local` (supervisor, firewall, filter, sandbox service,
API) inside a network namespace of the bench's own, as tests/e2e runs it: real podman (its
bridges in that namespace), the real filter, real nftables. Each start is a fresh session of
a small project (started, one command run in it, removed untimed), so every start meets the
appliance in the same state. One start before the timed ones is left out (the first after
`corral up` warms podman's and the kernel's caches; its times are kept in the row).

`corral run --json` says where a start went on the appliance (`took`: network, files,
filter, container: sandbox/sessions.py `create`). The filter's step holds its registration
and the firewall following it; the firewall's part is measured alone afterwards, through the
filter's own `Firewall.apply` on the same filter.toml (bench/ruleset.py), in a namespace of
its own: one more session with none registered, as each start is.

  measure(directory, starts) -> dict        (root; bench/run.py's `start` part)

The same starts against an appliance the CLI already knows (a VM `corral up` made, say: the
bench brings none up, as one costs minutes to provision under QEMU without KVM), from this
host, without the firewall's part (it runs on that appliance):

  python -m bench.start --appliance NAME [--starts 10]       prints the rows as JSON
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .netns import PREFIX, sh

NAMESPACE = PREFIX + "start"
APPLIANCE = "bench-start"
UPSTREAM = "192.0.2.53:53"
"""The filter's resolver: nothing answers there, and no start asks it anything."""
STEPS = ("network", "files", "filter", "container")
BIN = Path(sys.executable).parent


def p95(values: list[float]) -> float:
    """The nearest-rank 95th percentile (of 10 values: the largest)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


class Appliance:
    """`corral up --backend local` in NAMESPACE, and the CLI run there; or (`name` given) an
    appliance the CLI knows, the CLI run here as a person runs it."""

    def __init__(self, directory: Path, name: str | None = None):
        self.dir, self.name = directory, name or APPLIANCE
        self.state = directory / "state"
        # a person's Python keeps the bytecode it compiles (__pycache__): the CLI run here
        # does too (and `corral up`'s services, writing into the tree they run from), even
        # where the bench's own caller said not to (PYTHONDONTWRITEBYTECODE, which made
        # every start compile the CLI's modules again: 30-40 ms measured)
        environ = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        self.env = environ if name else {**environ, "XDG_CONFIG_HOME": str(directory / "config")}
        self.inside = [] if name else ["nsenter", f"--net=/run/netns/{NAMESPACE}"]

    def corral(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        command, *rest = args
        if command != "up":
            rest = ["--appliance", self.name, *rest]
        result = subprocess.run([*self.inside, str(BIN / "corral"), command, *rest],
                                capture_output=True, text=True, timeout=timeout, env=self.env)
        if result.returncode != 0:
            raise RuntimeError(f"corral {' '.join(args)}: exit {result.returncode}\n"
                               f"{result.stdout[-2000:]}{result.stderr[-2000:]}")
        return result

    def podman(self, *args: str) -> None:
        """podman as the appliance's sandbox service runs it (its containers.conf)."""
        subprocess.run(["nsenter", f"--net=/run/netns/{NAMESPACE}", "env",
                        f"CONTAINERS_CONF={self.state / 'containers.conf'}", "podman", *args],
                       capture_output=True, timeout=120)

    def up(self) -> None:
        sh("ip", "netns", "add", NAMESPACE)
        sh("ip", "link", "set", "lo", "up", ns=NAMESPACE)
        self.corral("up", "--backend", "local", "--name", APPLIANCE, "--state-dir",
                    str(self.state), "--upstream", UPSTREAM, timeout=1800)  # the image, once

    def down(self) -> None:
        """Whatever came up goes: sessions, services and ruleset, then the namespace."""
        try:
            if (self.state / "supervisor.pid").exists():
                self.corral("down", timeout=180)
        finally:
            sh("ip", "netns", "del", NAMESPACE, check=False)

    def forget(self, names: list[str]) -> None:
        """Containers and networks of these names an interrupted run may have left."""
        for name in names:
            self.podman("rm", "--force", f"corral-{name}")
            self.podman("network", "rm", "--force", f"corral-{name}")

    def own_start(self) -> float:
        """Seconds for `corral shell --help`: the CLI's own start (the interpreter, the
        imports a session command makes), which `run` and `shell` each pay before they ask
        the appliance anything."""
        begun = time.perf_counter()
        subprocess.run([*self.inside, str(BIN / "corral"), "shell", "--help"], check=True,
                       capture_output=True, env=self.env, timeout=60)
        return time.perf_counter() - begun

    def start(self, name: str, project: Path) -> dict:
        """One start, timed: run --detach, then the first command; then removed, untimed."""
        begun = time.perf_counter()
        record = json.loads(self.corral("run", "--project", str(project), "--name", name,
                                        "--detach", "--json").stdout)
        running = time.perf_counter()
        try:
            self.corral("shell", name, "--", "true")
            done = time.perf_counter()
        finally:
            self.corral("rm", name)
        return {"run_s": running - begun, "shell_s": done - running, "first_s": done - begun,
                "took": record["took"], "cli_s": self.own_start()}


def firewall_apply(directory: Path, reps: int) -> dict:
    """The firewall's part of the filter's step: one more session with none registered,
    through the filter's own Firewall on the local appliance's filter.toml (its state
    directory moved aside), in a namespace of its own (bench/ruleset.py)."""
    state = directory / "state"
    text = (state / "filter.toml").read_text()
    old = str(state / "filter")
    if f'"{old}"' not in text:
        raise RuntimeError(f"{state / 'filter.toml'} names no state directory {old}")
    config = directory / "firewall.toml"
    config.write_text(text.replace(f'"{old}"', f'"{directory / "firewall-state"}"'))
    (directory / "firewall-state").mkdir()
    namespace = PREFIX + "start-fw"
    sh("ip", "netns", "add", namespace)
    try:
        return json.loads(sh(sys.executable, "-m", "bench.ruleset", "0", str(reps),
                             str(directory / "firewall-state"), str(config),
                             ns=namespace).stdout)
    finally:
        sh("ip", "netns", "del", namespace, check=False)


def _project(directory: Path) -> Path:
    """The small project each start copies in."""
    project = directory / "project"
    (project / "src").mkdir(parents=True)
    (project / "corral.toml").write_text('[http]\nallow = ["pypi.org"]\n')
    (project / "src" / "app.py").write_text("print('hello')\n")
    (project / "README.md").write_text("a small project\n")
    return project


def measure(directory: Path, starts: int) -> dict:
    """{"starts": [...each start's times and took], "warm_up": {...}, "firewall": {...}}."""
    project = _project(directory)
    appliance = Appliance(directory)
    names = [f"bstart{i}" for i in range(starts + 1)]
    sh("ip", "netns", "del", NAMESPACE, check=False)  # an interrupted run's
    try:
        appliance.up()
        appliance.forget(names)
        warm_up, *timed = [appliance.start(name, project) for name in names]
    finally:
        try:
            appliance.down()
        finally:
            appliance.forget(names)
    return {"starts": timed, "warm_up": warm_up,
            "firewall": firewall_apply(directory, max(starts, 3))}


def rows(result: dict) -> list[dict]:
    """The start row (run --detach, the first command, both together) with `took`'s medians
    and the firewall's part."""
    starts = result["starts"]
    took = {step: statistics.median(s["took"][step] for s in starts) for step in STEPS}
    breakdown = {f"{step}_ms": round(seconds * 1000, 1) for step, seconds in took.items()}
    breakdown["outside_ms"] = round((statistics.median(s["run_s"] for s in starts)
                                     - sum(took.values())) * 1000, 1)
    breakdown["cli_ms"] = round(statistics.median(s["cli_s"] for s in starts) * 1000, 1)
    if "firewall" in result:  # measured alone, on the local backend
        firewall_ms = statistics.median(result["firewall"]["load_ms"])
        breakdown.update(firewall_apply_ms=round(firewall_ms, 1),
                         registration_ms=round(took["filter"] * 1000 - firewall_ms, 1))
    out = []
    for metric, key in (("session start: run --detach", "run_s"),
                        ("session start: first shell -- true", "shell_s"),
                        ("session start: first command done", "first_s")):
        values = [s[key] for s in starts]
        row = {"metric": metric, "tool": "corral", "unit": "s",
               "value": round(statistics.median(values), 3), "n": len(values),
               "p50_s": round(statistics.median(values), 3), "p95_s": round(p95(values), 3),
               "min": round(min(values), 3), "max": round(max(values), 3),
               "warm_up_s": round(result["warm_up"][key], 3),
               "backend": result.get("backend", "local")}
        if key == "run_s":
            row.update(breakdown)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.start",
                                     description="session starts on an appliance the CLI "
                                     "knows (a VM, say): run --detach, the first command")
    parser.add_argument("--appliance", required=True, metavar="NAME")
    parser.add_argument("--starts", type=int, default=10)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="corral-bench-start-") as tmp:
        project = _project(Path(tmp))
        appliance = Appliance(Path(tmp), args.appliance)
        names = [f"bstart{i}" for i in range(args.starts + 1)]
        warm_up, *timed = [appliance.start(name, project) for name in names]
    result = {"starts": timed, "warm_up": warm_up, "backend": f"appliance {args.appliance}"}
    print(json.dumps(rows(result), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
