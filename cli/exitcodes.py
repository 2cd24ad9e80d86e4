"""Exit codes of the `corral` command, named in one place (scripts depend on them)."""

OK = 0
FAILURE = 1
"""Something went wrong that is not the user's input (or the appliance refused it)."""
USAGE = 2
"""Bad arguments, or a config/policy file that does not parse."""
UNREACHABLE = 3
"""The appliance (or its filter) did not answer, or TLS with it failed."""
NOT_CONFIGURED = 4
"""No such appliance, or no credentials for it on this machine."""
AUDIT_BROKEN = 5
"""`corral audit --verify` found the hash chain broken."""
DIFFERENT = 6
"""`corral verify --against` found the two appliances' manifests differ."""
