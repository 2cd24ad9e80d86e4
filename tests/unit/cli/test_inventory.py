"""`corral inventory`: what vagrant says of a VM, as the inventory Ansible reads (parsed here
by Ansible's own INI reader, so the variables have the types the roles expect)."""

from __future__ import annotations

import pytest
from ansible.inventory.manager import InventoryManager
from ansible.parsing.dataloader import DataLoader

from cli.inventory import host_line, parse_ssh_config, render

SSH_CONFIG = """\
Host default
  HostName 192.168.121.204
  User vagrant
  Port 22
  UserKnownHostsFile /dev/null
  StrictHostKeyChecking no
  PasswordAuthentication no
  IdentityFile /home/a user/.config/corral/appliances/one/vagrant/machines/default/libvirt/key
  IdentitiesOnly yes
  LogLevel FATAL
"""


def test_vagrant_ssh_config_gives_the_connection():
    assert parse_ssh_config(SSH_CONFIG) == {
        "ansible_host": "192.168.121.204", "ansible_port": "22", "ansible_user": "vagrant",
        "ansible_ssh_private_key_file":
            "/home/a user/.config/corral/appliances/one/vagrant/machines/default/libvirt/key"}


def test_an_answer_without_an_address_is_refused_by_name():
    with pytest.raises(ValueError, match="no ansible_host"):
        parse_ssh_config(SSH_CONFIG.replace("HostName", "Hostname-not"))


def test_ansible_reads_each_appliance_with_the_vagrantfiles_variables(tmp_path):
    connection = parse_ssh_config(SSH_CONFIG)
    pinned = ("-o 'UserKnownHostsFile=\"/home/a user/k%%h\"' -o GlobalKnownHostsFile=/dev/null "
              "-o HostKeyAlias=corral-appliance-one -o StrictHostKeyChecking=yes")
    text = render([
        host_line("one", connection, "127.0.0.1:8443", ["/etc/ca's/a.crt", "/etc/b.crt"],
                  pinned),
        host_line("two", {**connection, "ansible_host": "192.168.121.9"}, "127.0.0.1:8444", [],
                  "-o HostKeyAlias=corral-appliance-two")])
    path = tmp_path / "inventory.ini"
    path.write_text(text)
    hosts = InventoryManager(loader=DataLoader(), sources=[str(path)])
    one, two = hosts.get_host("one").get_vars(), hosts.get_host("two").get_vars()
    group = hosts.groups["corral"].get_vars()
    assert one["ansible_host"] == "192.168.121.204" and two["ansible_host"] == "192.168.121.9"
    assert one["ansible_ssh_private_key_file"] == connection["ansible_ssh_private_key_file"]
    assert one["ansible_ssh_common_args"] == pinned  # as given: Ansible splits it for ssh
    assert one["ansible_ssh_host_key_checking"] is True  # over the config and environment
    assert two["ansible_ssh_common_args"] == "-o HostKeyAlias=corral-appliance-two"
    assert one["corral_pki_endpoint"] == "127.0.0.1:8443"
    assert two["corral_pki_endpoint"] == "127.0.0.1:8444"
    assert one["corral_base_extra_ca_files"] == ["/etc/ca's/a.crt", "/etc/b.crt"]
    assert "corral_base_extra_ca_files" not in two
    assert group["corral_sandbox_image_archive"] == ""
    assert group["corral_filter_host_gateway"] == (
        "{{ ansible_facts.default_ipv4.gateway | default('') }}")
    assert group["ansible_python_interpreter"] == "/usr/bin/python3"
