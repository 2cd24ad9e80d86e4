"""What the VM tier leaves in libvirt, and takes away.

- A domain of the tier's names that a killed run left (its destroy never ran) stops the next
  run's `vagrant up` at once: "Name `corral-vmtest-default` of domain about to create is
  already taken". It is removed, with its disk, before the tier starts.
- vagrant-libvirt uploads a box into the storage pool once per box version and never removes
  it, and `corral box build` adds a new version each run: 1.7 GB a run. Box volumes that no
  domain's disk is backed by are removed when the tier ends (a VM of the user's on this host,
  made from the box, keeps its own).
"""

from __future__ import annotations

import json
import subprocess

VIRSH = ["virsh", "-c", "qemu:///system"]
BOX_VOLUMES = "corral-VAGRANTSLASH-"
"""How vagrant-libvirt names the volumes of corral's boxes (`corral/debian13`)."""


def _virsh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*VIRSH, *args], capture_output=True, text=True, timeout=120)


def remove_domain(name: str) -> bool:
    """Domain `name` stopped and undefined with its disks; False if there was none."""
    if _virsh("dominfo", name).returncode != 0:
        return False
    _virsh("destroy", name)  # fails when it is not running: that is fine
    undefined = _virsh("undefine", name, "--remove-all-storage")
    assert undefined.returncode == 0, f"cannot remove the stale domain {name}: {undefined.stderr}"
    return True


def _disks(domain: str) -> list[str]:
    listed = _virsh("domblklist", domain, "--details").stdout.splitlines()
    return [fields[3] for fields in (line.split() for line in listed)
            if len(fields) == 4 and fields[1] == "disk" and fields[3].startswith("/")]


def _backing(image: str) -> str | None:
    """The file `image` is backed by ('' if none), or None if it cannot be read."""
    info = subprocess.run(["qemu-img", "info", "--force-share", "--output=json", image],
                          capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        return None
    return json.loads(info.stdout).get("full-backing-filename", "")  # "": none


def remove_unused_box_volumes() -> list[str]:
    """The box volumes in the default pool that no domain's disk is backed by, deleted; their
    names. A disk that cannot be read counts as using every volume: nothing is removed."""
    volumes = _virsh("vol-list", "default")
    if volumes.returncode != 0:  # no pool yet: no vagrant up ever ran here
        return []
    boxes = {}
    for line in volumes.stdout.splitlines()[2:]:
        fields = line.split()
        if len(fields) == 2 and fields[0].startswith(BOX_VOLUMES):
            boxes[fields[0]] = fields[1]
    used = set()
    for domain in _virsh("list", "--all", "--name").stdout.split():
        for disk in _disks(domain):
            backing = _backing(disk)
            if backing is None:
                return []
            used.add(backing)
    removed = []
    for name, path in sorted(boxes.items()):
        if path not in used and _virsh("vol-delete", "--pool", "default", name).returncode == 0:
            removed.append(name)
    return removed
