"""What the VM tier leaves in libvirt, and takes away.

- A domain of the tier's names that a killed run left (its destroy never ran) stops the next
  run's `vagrant up` at once: "Name `corral-vmtest-default` of domain about to create is
  already taken". It is removed, with its disk, before the tier starts.
- vagrant-libvirt uploads a box into the storage pool once per box version and never removes
  it, and `corral box build` adds a new version each run: 1.7 GB a run. Box volumes that no
  domain's disk is backed by (at any depth) and that are an hour old are removed when the
  tier ends: a VM of the user's made from the box keeps its own, and each run's own is
  removed by a later run.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

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


def _disks(domain: str) -> list[str] | None:
    """The files of `domain`'s disks; None if libvirt cannot say."""
    listed = _virsh("domblklist", domain, "--details")
    if listed.returncode != 0:
        return None
    return [fields[3] for fields in (line.split() for line in listed.stdout.splitlines())
            if len(fields) == 4 and fields[1] == "disk" and fields[3] != "-"]


def _chain(image: str) -> list[str] | None:
    """`image` and every file under it (backing files, all the way down); None if it cannot
    be read."""
    info = subprocess.run(["qemu-img", "info", "--force-share", "--backing-chain",
                           "--output=json", image], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        return None
    return [os.path.realpath(layer["filename"]) for layer in json.loads(info.stdout)]


def remove_unused_box_volumes(settle: float = 3600) -> list[str]:
    """The box volumes in the default pool that no domain's disk is, or is backed by at any
    depth, and that nothing wrote in the last `settle` seconds (a box another `vagrant up`
    is uploading has no domain yet), deleted; their names. When libvirt or a disk cannot be
    read, nothing is removed."""
    volumes = _virsh("vol-list", "default")
    domains = _virsh("list", "--all", "--name")
    if volumes.returncode != 0 or domains.returncode != 0:
        return []
    boxes = {}
    for line in volumes.stdout.splitlines()[2:]:
        fields = line.split()
        if len(fields) == 2 and fields[0].startswith(BOX_VOLUMES):
            boxes[fields[0]] = os.path.realpath(fields[1])
    used = set()
    for domain in domains.stdout.split():
        disks = _disks(domain)
        if disks is None:
            return []
        for disk in disks:
            chain = _chain(disk)
            if chain is None:
                return []
            used.update(chain)
    removed = []
    for name, path in sorted(boxes.items()):
        try:
            fresh = time.time() - os.stat(path).st_mtime < settle
        except OSError:
            continue
        if path not in used and not fresh and _virsh(
                "vol-delete", "--pool", "default", name).returncode == 0:
            removed.append(name)
    return removed
