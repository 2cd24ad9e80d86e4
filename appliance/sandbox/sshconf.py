"""A session's ssh client, pointed at the git gateway (filter/git/sshgate.py) for the hosts it
serves: `git clone git@github.com:acme/widget.git` works in a session as it does anywhere,
and reaches github.com only through the gateway, which holds the key github.com knows.

Three files in the session's trust directory (trust.py), which is mounted read-only:

  ssh_config       a `Host` block per git host: the gateway's address and port, the
                   session's key, the gateway's host key as the one to expect, and
                   CORRAL_GIT_HOST to name the host (SetEnv); mounted as
                   /etc/ssh/ssh_config.d/corral.conf, which Debian's ssh_config includes
  ssh_known_hosts  the gateway's host key, under HostKeyAlias
  ssh_key          the session's own key: good at the gateway, for this session, only

An agent may write its own ~/.ssh/config; that only sends its ssh elsewhere, where the
firewall stops it (the gateway is the one way to a git host over SSH).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from appliance.atomic import write_atomic
from appliance.policy.git import SSH_HOST_VARIABLE

from .trust import TRUST_DIR

CONFIG, KNOWN_HOSTS, KEY = "ssh_config", "ssh_known_hosts", "ssh_key"
SYSTEM_CONFIG = "/etc/ssh/ssh_config.d/corral.conf"
"""Where the config is mounted: Debian's /etc/ssh/ssh_config includes it first."""
ALIAS = "corral-git-gateway"
_HOST = re.compile(r"[a-z0-9][a-z0-9.-]{0,252}")
_PUBLIC_KEY = re.compile(r"ssh-ed25519 [A-Za-z0-9+/=]+")


def config_text(gateway: str, port: int, hosts: list[str], directory: str = TRUST_DIR) -> str:
    """The config, its files named where the session sees them (`directory`)."""
    blocks = ["# corral: git over SSH to these hosts goes through the appliance's git gateway,",
              "# which holds the key each host knows; the key below is this session's own.",
              ""]
    for host in hosts:
        if not _HOST.fullmatch(host):  # a name the filter checked; never a line of config
            raise ValueError(f"not a host name: {host!r}")
        blocks += [f"Host {host}",
                   f"    HostName {gateway}",
                   f"    Port {port}",
                   f"    HostKeyAlias {ALIAS}",
                   "    StrictHostKeyChecking yes",
                   f"    UserKnownHostsFile {directory}/{KNOWN_HOSTS}",
                   "    GlobalKnownHostsFile /dev/null",
                   "    CheckHostIP no",
                   f"    IdentityFile {directory}/{KEY}",
                   "    IdentitiesOnly yes",
                   "    IdentityAgent none",
                   "    PasswordAuthentication no",
                   "    KbdInteractiveAuthentication no",
                   f"    SetEnv {SSH_HOST_VARIABLE}={host}",
                   ""]
    return "\n".join(blocks)


def write(directory: Path, gateway: str, files: dict | None, root: int | None = None) -> bool:
    """The three files, when the filter has a gateway (`files`: its answer, as
    sshgate.Gate.session_files gives it) and hosts to reach through it. True if written:
    the config is then to be mounted. `root`: the host ID the session's root maps to, made
    the config's owner (ssh reads an included config only when root or the user owns it)."""
    if not files or not files.get("hosts"):
        for name in (CONFIG, KNOWN_HOSTS, KEY):  # an earlier session's of the same name
            (directory / name).unlink(missing_ok=True)
        return False
    host_key = files["host_key"].strip()
    if not _PUBLIC_KEY.fullmatch(host_key):
        raise ValueError("the gateway's host key is not an ssh-ed25519 public key")
    # read by the agent: ssh takes a key others may read when its owner is not the user
    # (this file's, root on the appliance, is nobody inside the session's user namespace)
    write_atomic(directory / KEY, files["key"].encode(), mode=0o644)
    write_atomic(directory / KNOWN_HOSTS, f"{ALIAS} {host_key}\n".encode(), mode=0o644)
    write_atomic(directory / CONFIG,
                 config_text(gateway, int(files["port"]), list(files["hosts"])).encode(),
                 mode=0o644)
    if root is not None:
        os.chown(directory / CONFIG, root, root)
    return True
