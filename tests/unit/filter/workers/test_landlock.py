"""The workers' Landlock ruleset, restricted by the kernel in a process of its own, which
then tries to read what a taken-over worker would (and what a worker needs)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap

from appliance.filter.workers import landlock

from .test_jail import ATTEMPT

PROBE = ATTEMPT + textwrap.dedent("""
    import json, os, sys
    from appliance.filter.workers import landlock
    from appliance.filter.workers.confine import drop_capabilities
    secret, ca, here = sys.argv[1:]
    drop_capabilities()  # no_new_privs, as a worker has it
    # the CA dir given as a way up into the state directory too: kept out
    state = os.path.dirname(secret)
    abi = landlock.restrict(landlock.readable([ca, os.path.join(ca, "..", "state")],
                                              [state]))
    def memfd():
        fd = os.memfd_create("leaf")
        os.write(fd, b"leaf")
        assert open(f"/proc/self/fd/{fd}", "rb").read() == b"leaf"
    attempt("a secret beside it", lambda: open(secret).read())
    attempt("its directory", lambda: os.listdir(os.path.dirname(secret)))
    attempt("the root", lambda: os.listdir("/"))
    attempt("the parent's /proc", lambda: open(f"/proc/{os.getppid()}/status").read())
    attempt("a file written", lambda: open(os.path.join(here, "planted"), "w"))
    attempt("a directory made", lambda: os.mkdir(os.path.join(here, "planted.d")))
    attempt("the CA", lambda: open(os.path.join(ca, "ca.pem")).read())
    attempt("its own /proc", lambda: open("/proc/self/status").read())
    attempt("the filter's sockets", lambda: open("/proc/self/net/tcp").read())
    attempt("a leaf's memfd", memfd)
    attempt("the trust store", lambda: __import__("ssl").create_default_context())
    attempt("uvloop", lambda: __import__("uvloop").new_event_loop().close())
    attempt("a lazy import", lambda: __import__("appliance.filter.proxy.inspect"))
    attempt("random", lambda: open("/dev/urandom", "rb").read(8))
    print(json.dumps({"abi": abi, "tried": tried}))
""")


def test_a_restricted_process_reads_its_code_and_the_ca_and_nothing_else(tmp_path):
    state, ca, here = tmp_path / "state", tmp_path / "ca", tmp_path / "here"
    for directory in (state, ca, here):
        directory.mkdir()
    (state / "secrets.json").write_text('{"token": "s3cret"}')
    (ca / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    done = subprocess.run([sys.executable, "-c", PROBE, str(state / "secrets.json"), str(ca),
                           str(here)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    told = json.loads(done.stdout)
    assert told["abi"] >= 1
    assert told["tried"] == {
        "a secret beside it": errno.EACCES, "its directory": errno.EACCES,
        "the root": errno.EACCES, "the parent's /proc": errno.EACCES,
        "a file written": errno.EACCES, "a directory made": errno.EACCES, "the CA": "ok",
        "its own /proc": errno.EACCES, "the filter's sockets": errno.EACCES,
        "a leaf's memfd": "ok", "the trust store": "ok",
        "uvloop": "ok", "a lazy import": "ok", "random": "ok"}
    assert not os.listdir(here)


def test_the_root_and_the_working_directory_are_never_readable_paths(tmp_path, monkeypatch):
    """`python -m` puts the working directory first on sys.path, and systemd's is /."""
    monkeypatch.chdir("/")
    monkeypatch.syspath_prepend("/")
    paths = landlock.readable(["/", str(tmp_path)])
    assert "/" not in paths and str(tmp_path) in paths
    assert all(os.path.isabs(p) and os.path.exists(p) for p in paths)


def test_no_path_that_holds_a_kept_out_one_is_given_however_spelt(tmp_path, monkeypatch):
    state = tmp_path / "state"
    (state / "intercept").mkdir(parents=True)
    (tmp_path / "link").symlink_to(state)
    monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path))  # the operator's, too broad
    paths = landlock.readable([str(state / "intercept"), f"{state}/intercept/..",
                               str(tmp_path / "link")], [str(state)])
    assert str(state / "intercept") in paths  # beneath the state directory: its own part
    assert not [p for p in paths if str(state).startswith(p)], paths
