"""`python -m appliance.filter.audit verify PATH [HEAD]`: check the chain of the log whose
active segment is PATH (against HEAD, the JSON `{"seq", "hash"}` the filter reports) and
print the verdict as one JSON line.

The filter runs its `audit-verify` this way, in a process of its own: hashing and parsing
hundreds of MB in one of its threads made its event loop wait for the interpreter's lock
(and for the garbage collector), up to 100 ms at a time, while the verify ran.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .reader import verify


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3) or args[0] != "verify":
        print("usage: python -m appliance.filter.audit verify PATH [HEAD-JSON]",
              file=sys.stderr)
        return 2
    head = json.loads(args[2]) if len(args) == 3 else None
    print(json.dumps(verify(Path(args[1]), head).to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
