"""The filter configuration the unit tests of its parts start from."""

from __future__ import annotations

from pathlib import Path

from appliance.sessionconfig import FilterConfig, parse_config


def one_session(tmp_path: Path, before: str = "", session: str = "") -> FilterConfig:
    """State and the control socket under `tmp_path`, and one session, s1 on
    10.213.1.0/24: `before` adds tables ahead of them, `session` keys to s1's table."""
    return parse_config(f"""{before}
[state]
dir = "{tmp_path}/state"
[control]
socket = "{tmp_path}/control.sock"
[[session]]
name = "s1"
subnet = "10.213.1.0/24"
{session}""", str(tmp_path / "filter.toml"))
