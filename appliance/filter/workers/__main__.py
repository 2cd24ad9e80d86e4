"""`python -m appliance.filter.workers --link-fd N --index I --first-id K`: one worker
process, as the coordinator starts it (worker.py)."""

import sys

from .worker import main

sys.exit(main())
