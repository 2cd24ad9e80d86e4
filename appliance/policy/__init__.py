"""The policy model: rules, layers, presets, parsing and pure decisions. Standard library only.

Typical use:

    rules = [*DEFAULT_RULES, *policy_file_rules(text, "corral.toml", "project")]
    policy = Policy(rules)
    policy.decide_http(parse_host("api.example.com"), 443)  # -> Decision
    inspection = policy.inspection(parse_host("api.github.com"))  # -> Inspection | None
    inspection.decide("PUT", "/repos/acme/widget/pulls/1/merge")  # -> Decision
"""

from .config import ConfigError, PolicyDocument, parse_policy, parse_toml
from .decide import HOST_NAME, Policy
from .decision import Decision
from .inspection import Inspection
from .layers import (
    DEFAULT_RULES,
    dedupe,
    policy_file_rules,
    preset_description,
    preset_names,
    preset_parameters,
    preset_rules,
)
from .names import (
    PLACEHOLDER_MARK,
    Host,
    HostNameError,
    normalise_name,
    parse_address,
    parse_host,
    split_host_port,
)
from .parameters import PresetRef
from .patterns import PatternError, RequestSpec
from .ranges import blocked_range
from .rules import KINDS, LAYERS, PortSpec, Rule, RuleError

__all__ = [
    "DEFAULT_RULES",
    "HOST_NAME",
    "KINDS",
    "LAYERS",
    "PLACEHOLDER_MARK",
    "ConfigError",
    "Decision",
    "Host",
    "HostNameError",
    "Inspection",
    "PatternError",
    "Policy",
    "PolicyDocument",
    "PortSpec",
    "PresetRef",
    "RequestSpec",
    "Rule",
    "RuleError",
    "blocked_range",
    "dedupe",
    "normalise_name",
    "parse_address",
    "parse_host",
    "parse_policy",
    "parse_toml",
    "policy_file_rules",
    "preset_description",
    "preset_names",
    "preset_parameters",
    "preset_rules",
    "split_host_port",
]
