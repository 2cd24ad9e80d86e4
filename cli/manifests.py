"""`corral verify --against OTHER`: two appliances' manifests, compared difference by
difference. Each manifest is the one provisioning recorded (GET /v1/manifest, served by the
appliance's API from /etc/corral/manifest.json), so it works for any appliance the CLI has
credentials for: a VM, a host provisioned from an inventory. That each appliance still runs
what its manifest says is `corral verify`'s other half (the check run on the appliance)."""

from __future__ import annotations

import json

from appliance.manifest import Comparison, ManifestError, compare, loads

from . import exitcodes, output
from .client import Client, CliError, load_appliance


def fetch(name: str) -> dict:
    """The manifest appliance `name` was provisioned to, checked to be one."""
    answer = Client(load_appliance(name)).request("GET", "/manifest")
    try:
        return loads(json.dumps(answer), f"appliance {name}'s manifest")
    except ManifestError as exc:
        raise CliError(str(exc), f"provision {name} again (`corral provision --appliance "
                       f"{name}`, or site.yml)") from None


def against(first: str, second: str, as_json: bool) -> int:
    comparison = compare(fetch(first), fetch(second), across=True)
    if as_json:
        output.data({"appliances": [first, second], **comparison.to_json()})
    else:
        show(first, second, comparison)
    return exitcodes.DIFFERENT if comparison.differences else exitcodes.OK


def show(first: str, second: str, comparison: Comparison) -> None:
    for difference in comparison.differences:
        output.line(str(difference))
    if comparison.differences:
        output.line(f"{len(comparison.differences)} difference(s) between {first} (before "
                    f"the arrow) and {second} (after it)")
    else:
        output.line(f"{first} and {second} are identical: the same packages, wheels, images, "
                    "files, units, ruleset and policy")
    if comparison.expected:
        output.line("expected to differ (each appliance's own):")
        for difference in comparison.expected:
            output.line(f"  {difference}")
