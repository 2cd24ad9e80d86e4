"""Service config files (the API's, the sandbox service's): every mistake is named."""

from __future__ import annotations

import pytest

from appliance.api.config import load as load_api
from appliance.policy import ConfigError
from appliance.sandbox.service import load as load_sandbox


@pytest.mark.parametrize(("text", "message"), [
    ("[sandbox]\nsocket = 5\n", "sandbox.toml:2: [sandbox] socket: must be a string, got 5"),
    ("[sandbox]\nproxy_port = true\n", "[sandbox] proxy_port: must be a whole number"),
    ("[sandbox]\nproxy_port = 0\n", "[sandbox] proxy_port: must be a positive whole number"),
    ("[sandbox]\nsocket = \"\"\n", "[sandbox] socket: must be a non-empty string"),
    ("[sandbox]\npoool = \"10.0.0.0/8\"\n", "sandbox.toml:2: [sandbox] poool: unknown key"),
    ("[sandbx]\n", "sandbox.toml:1: sandbx: unknown key; expected [sandbox]"),
    ("[sandbox\n", "not valid TOML"),
])
def test_sandbox_config_errors_name_file_line_and_key(tmp_path, text, message):
    path = tmp_path / "sandbox.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_sandbox(str(path))
    assert message in str(info.value)


def test_sandbox_config_defaults_and_values(tmp_path):
    path = tmp_path / "sandbox.toml"
    path.write_text('[sandbox]\nsocket = "/run/x.sock"\ngroup = "corral-api"\n')
    config = load_sandbox(str(path))
    assert (config.socket, config.group, config.pool) == ("/run/x.sock", "corral-api",
                                                          "10.213.0.0/16")


@pytest.mark.parametrize(("text", "message"), [
    ("[api]\nmax_upload = -1\n", "[api] max_upload: must be a positive whole number"),
    ("[api]\nlisten = \"nohost\"\n", "[api] listen: 'nohost' needs host:port"),
    ("[api]\nthreads = \"8\"\n", "api.toml:2: [api] threads: must be a whole number"),
])
def test_api_config_errors(tmp_path, text, message):
    path = tmp_path / "api.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_api(str(path))


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_sandbox(str(tmp_path / "absent.toml"))
