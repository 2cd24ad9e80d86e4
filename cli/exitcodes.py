"""Exit codes of the `corral` command, named in one place (scripts depend on them)."""

OK = 0
FAILURE = 1
"""Something went wrong that is not the user's input."""
USAGE = 2
"""Bad arguments, or a config/policy file that does not parse."""
