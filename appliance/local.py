"""The local backend's supervisor: the appliance's services as child processes of this one.

  python -m appliance.local --state-dir DIR     (started, detached, by `corral up --backend
                                                 local`; stopped by `corral down`)

Start-up, in order, each waiting for the one before to answer: the firewall ruleset (so
nothing leaves before the filter is there: fail closed), corral-filter, corral-sandbox,
corral-api. A child that exits is restarted with a growing delay (1 s doubling to 30 s, back
to 1 s after a minute of running). Logs go to DIR/logs/<service>.log.

SIGTERM brings it down the other way round: running sessions are stopped first (a sandbox
must never outlive the ruleset that confines it), then the API, the sandbox service and the
filter, and last the ruleset is removed. When the sessions cannot be stopped, the ruleset
stays: closed, not open.

Standard library only (and appliance.control_client, which is too); the services are run by
their console scripts, next to this Python.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from appliance.control_client import ControlClient, ServiceUnavailable

log = logging.getLogger("corral.local")
BIN = Path(sys.executable).parent


class Child:
    def __init__(self, name: str, command: list[str], logs: Path, socket_path: str | None):
        self.name, self.command, self.logs, self.socket = name, command, logs, socket_path
        self.process: subprocess.Popen | None = None
        self.started = 0.0
        self.delay = 1.0
        self.due = 0.0  # when a crashed child may start again

    def start(self) -> None:
        with open(self.logs / f"{self.name}.log", "ab") as out:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=out,
                                            stdin=subprocess.DEVNULL)
        self.started = time.monotonic()
        log.info("started %s (pid %d)", self.name, self.process.pid)

    def ready(self) -> bool:
        if self.socket is None:
            return True
        try:
            return bool(ControlClient(self.socket, self.name, timeout=5).request(
                {"op": "status"}).get("ok"))
        except (ServiceUnavailable, ValueError):
            return False

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.process.poll() is not None:
                said = self.last_words()
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}"
                                   f"{': ' + said if said else ''}; see "
                                   f"{self.logs / (self.name + '.log')}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not answer within {timeout:.0f}s")
            time.sleep(0.1)

    def last_words(self) -> str:
        """The last line the child wrote to its log (why it exited, as the services say it
        last), or ""."""
        try:
            with open(self.logs / f"{self.name}.log", "rb") as log_file:
                log_file.seek(0, os.SEEK_END)
                log_file.seek(max(0, log_file.tell() - 4096))
                lines = log_file.read().decode(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1].strip() if lines else ""

    def stop(self, timeout: float = 15) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        log.info("stopped %s", self.name)

    def watch(self) -> None:
        """Restart after a crash, with backoff; called every tick."""
        now = time.monotonic()
        if self.process.poll() is None:
            if now - self.started > 60:
                self.delay = 1.0
            return
        if not self.due:
            log.warning("%s exited with %s; restarting in %.0fs", self.name,
                        self.process.returncode, self.delay)
            self.due = now + self.delay
            self.delay = min(self.delay * 2, 30)
        elif now >= self.due:
            self.due = 0.0
            self.start()


class Supervisor:
    def __init__(self, state_dir: Path):
        self.dir = state_dir
        self.logs = state_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        filter_config = tomllib.loads((state_dir / "filter.toml").read_text())
        sandbox_config = tomllib.loads((state_dir / "sandbox.toml").read_text())
        self.filter_socket = filter_config["control"]["socket"]
        self.sandbox = ControlClient(sandbox_config["sandbox"]["socket"], "the sandbox service",
                                     timeout=600)
        self.sandbox_records = Path(sandbox_config["sandbox"]["state_dir"]) / "sessions"
        self.children = [
            Child("filter", [str(BIN / "corral-filter"), "--config",
                             str(state_dir / "filter.toml")], self.logs, self.filter_socket),
            Child("sandbox", [str(BIN / "corral-sandbox"), "serve", "--config",
                              str(state_dir / "sandbox.toml")], self.logs, self.sandbox.path),
            Child("api", [str(BIN / "corral-api"), "--config", str(state_dir / "api.toml")],
                  self.logs, None),
        ]
        self.sandbox_child = self.children[1]
        self.stopping = False

    def firewall(self, *args: str) -> bool:
        result = subprocess.run([str(BIN / "corral-firewall"), *args], capture_output=True,
                                text=True, timeout=60)
        (log.info if result.returncode == 0 else log.error)(
            "corral-firewall %s: %s", " ".join(args), (result.stdout + result.stderr).strip())
        return result.returncode == 0

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        if not self.firewall("apply", "--config", str(self.dir / "filter.toml")):
            return 1
        try:
            for child in self.children:
                child.start()
                child.wait_ready()
        except RuntimeError as exc:
            log.error("start-up failed: %s", exc)
            self.shutdown()
            return 1
        (self.dir / "ready").write_text(str(os.getpid()))
        log.info("up: %s", ", ".join(c.name for c in self.children))
        while not self.stopping:
            for child in self.children:
                child.watch()
            time.sleep(0.5)
        return self.shutdown()

    def _stop(self, signum, frame) -> None:
        self.stopping = True

    def _stop_sessions(self) -> bool:
        """Ask the sandbox service to stop every session; True when none is left running.
        A sandbox service that is not running (it never started this time, or it exited)
        is not asked, nor said to be silent: the start-up error is the one thing to tell;
        its records say whether sessions may still be running."""
        running = self.sandbox_child.process
        if running is not None and running.poll() is None:
            try:
                answer = self.sandbox.request({"op": "stop-all"})
                log.info("sessions: %s", answer)
                return answer.get("ok", False)
            except ServiceUnavailable as exc:
                log.error("cannot stop sessions (%s)", exc)
        # no sandbox service: were there sessions? then their containers may still run
        records = [json.loads(p.read_text()) for p in self.sandbox_records.glob("*.json")]
        return not any(r.get("state") == "running" for r in records)

    def shutdown(self) -> int:
        (self.dir / "ready").unlink(missing_ok=True)
        sessions_stopped = self._stop_sessions()
        for child in reversed(self.children):
            child.stop()
        if sessions_stopped and self.firewall("remove"):
            (self.dir / "stopped").write_text("clean\n")
            return 0
        outcome = ("sessions may still be running: the ruleset stays loaded (closed, not "
                   "open); stop them with podman, then `corral-firewall remove`"
                   if not sessions_stopped else "the ruleset could not be removed")
        log.error(outcome)
        (self.dir / "stopped").write_text(outcome + "\n")
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m appliance.local",
                                     description="Supervise corral's services on this host.")
    parser.add_argument("--state-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    pidfile = args.state_dir / "supervisor.pid"
    pidfile.write_text(str(os.getpid()))
    try:
        return Supervisor(args.state_dir).run()
    finally:
        with contextlib.suppress(FileNotFoundError):
            pidfile.unlink()


if __name__ == "__main__":
    sys.exit(main())
