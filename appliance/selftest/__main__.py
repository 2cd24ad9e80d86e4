"""`python -m appliance.selftest`: the battery from a checkout (the image runs the zipapp)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m appliance.selftest"))
