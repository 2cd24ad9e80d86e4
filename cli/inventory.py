"""What `corral inventory` prints: an Ansible inventory for this host's VM appliances.

One inventory provisions and verifies several appliances at once (`site.yml`,
`verify.yml`), the way a team's inventory of Debian hosts does: `corral up --no-provision`
boots VMs from the box, this names each with the variables the Vagrantfile would have given
it, and a second run over the same inventory changes nothing on an appliance that `corral
up` provisioned. Pure functions; cli/vm.py asks vagrant and writes the file.
"""

from __future__ import annotations

import json
import shlex

GROUP_VARS = {
    "ansible_python_interpreter": "/usr/bin/python3",
    # what the Vagrantfile hands site.yml besides the per-appliance values
    "corral_sandbox_image_archive": '""',
    "corral_filter_host_gateway": "{{ ansible_facts.default_ipv4.gateway | default('') }}",
}
SSH_KEYS = {"HostName": "ansible_host", "Port": "ansible_port", "User": "ansible_user",
            "IdentityFile": "ansible_ssh_private_key_file"}


def parse_ssh_config(text: str) -> dict[str, str]:
    """`vagrant ssh-config`'s answer as the inventory's connection variables."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if key in SSH_KEYS and key not in found:
            found[SSH_KEYS[key]] = value.strip().strip('"')
    missing = sorted(set(SSH_KEYS.values()) - set(found))
    if missing:
        raise ValueError(f"`vagrant ssh-config` gave no {', '.join(missing)}")
    return found


def host_line(name: str, connection: dict[str, str], endpoint: str,
              trust: list[str], ssh_args: str) -> str:
    """One appliance: how to reach it (`ssh_args`: the options that check its host keys,
    as Ansible splits them), and what the Vagrantfile gives its provisioning."""
    words = [name, *(f"{k}={shlex.quote(connection[k])}" for k in SSH_KEYS.values()),
             # checked whatever the config or ANSIBLE_HOST_KEY_CHECKING says: a host
             # variable wins over both (and their StrictHostKeyChecking=no over ours)
             "ansible_ssh_host_key_checking=True",
             f"ansible_ssh_common_args={shlex.quote(ssh_args)}",
             f"corral_pki_endpoint={shlex.quote(endpoint)}"]
    if trust:  # a JSON list is a Python literal: Ansible's INI reader makes it a list
        words.append(f"corral_base_extra_ca_files={shlex.quote(json.dumps(trust))}")
    return " ".join(words)


def render(lines: list[str]) -> str:
    vars_ = [f"{k}={v}" for k, v in GROUP_VARS.items()]
    return ("# made by `corral inventory`: the VM appliances of this host\n[corral]\n"
            + "".join(f"{line}\n" for line in lines)
            + "\n[corral:vars]\n" + "".join(f"{v}\n" for v in vars_))
