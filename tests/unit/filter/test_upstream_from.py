"""`[dns] upstream_from`: the appliance forwards to the resolvers its network gave it."""

import pytest

from appliance.policy import ConfigError
from appliance.sessionconfig import load_config


def _config(tmp_path, dns: str):
    path = tmp_path / "filter.toml"
    path.write_text(f'[dns]\nlisten = ["127.0.0.1:0"]\n{dns}\n[state]\ndir = "{tmp_path}"\n')
    return str(path)


def test_nameservers_are_read_and_loopback_stubs_skipped(tmp_path):
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("# from DHCP\nnameserver 127.0.0.53\nnameserver 10.0.2.3\n"
                      "search example\nnameserver fe80::1%eth0\nnameserver ::1\n")
    config = load_config(_config(tmp_path, f'upstream_from = "{resolv}"'))
    assert config.dns.upstream == (("10.0.2.3", 53),)


@pytest.mark.parametrize(("dns", "resolv", "message"), [
    ('upstream_from = "{resolv}"', "nameserver 127.0.0.53\n", "names no nameserver other"),
    ('upstream_from = "{tmp}/missing"', None, "cannot read"),
    ('upstream = ["9.9.9.9:53"]\nupstream_from = "{resolv}"', "nameserver 10.0.0.1\n",
     "not both"),
])
def test_unusable_sources_are_refused_by_name(tmp_path, dns, resolv, message):
    if resolv is not None:
        (tmp_path / "resolv.conf").write_text(resolv)
    path = _config(tmp_path, dns.format(resolv=tmp_path / "resolv.conf", tmp=tmp_path))
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(path)
    assert "upstream_from" in str(caught.value)
