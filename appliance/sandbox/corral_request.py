"""corral-request: ask a person for a host from inside a corral session, with a reason.

  corral-request HOST[:PORT] --reason "TEXT" [--kind http|dns|tcp] [--wait SECONDS] [--json]

It asks the session's proxy at http://request.corral/ (the proxy named by HTTP_PROXY, which
every session has), which opens a pending approval a person sees in `corral approvals` and
decides with `corral approve` or `corral refuse`. Nothing here can grant anything: only a
person can, from outside the session.

Exit status: 0 approved (or allowed already), 1 refused (or not something a person can
approve), 2 a usage error or an ask the proxy did not take, 3 still pending (no decision
within --wait, or no --wait), 4 asked too often (try again later).

In the image at /usr/local/bin/corral-request (appliance/sandbox/image.py); standard
library only, Debian's python3.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
from urllib.parse import urlencode, urlsplit

ASK_HOST = "request.corral"
ASK_URL = f"http://{ASK_HOST}/"
EXIT = {"approved": 0, "allowed": 0, "refused": 1, "pending": 3}


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="corral-request", description="Ask a person for access to a host the session's "
        "policy denies, with a reason (they decide with `corral approve` or `corral refuse`).")
    parser.add_argument("host", metavar="HOST[:PORT]", help="e.g. docs.example.org, "
                        "registry.example.com:8443 ([v6]:port for an IPv6 literal)")
    parser.add_argument("--reason", required=True, help="why the task needs it (a person "
                        "reads it: printable ASCII, at most 300 characters)")
    parser.add_argument("--kind", choices=("http", "dns", "tcp"), default="http",
                        help="http (the default: HTTP and HTTPS through the proxy), dns (a "
                        "name only), tcp (HOST:PORT, a direct connection such as ssh)")
    parser.add_argument("--wait", type=int, default=0, metavar="SECONDS",
                        help="wait this long for the decision (0-600; default 0: ask and "
                        "return)")
    parser.add_argument("--json", action="store_true", help="print the proxy's JSON answer")
    args = parser.parse_args(argv)
    if not 0 <= args.wait <= 600:
        parser.error("--wait: 0 to 600 seconds")
    return args


def proxy_url() -> str | None:
    return os.environ.get("HTTP_PROXY") or os.environ.get("http_proxy")


def ask(args, proxy: str) -> tuple[int, dict]:
    """(HTTP status, JSON answer) from the proxy. Straight to the proxy, whatever NO_PROXY
    says (urllib would heed it): request.corral is only there."""
    parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"HTTP_PROXY {proxy!r} is not http://HOST:PORT")
    query = urlencode({"host": args.host, "reason": args.reason, "kind": args.kind,
                       "wait": args.wait})
    connection = http.client.HTTPConnection(parts.hostname, parts.port or 80,
                                            timeout=args.wait + 30)
    try:
        connection.request("GET", f"{ASK_URL}?{query}", headers={"Host": ASK_HOST})
        answer = connection.getresponse()
        body = answer.read(64 * 1024)
    finally:
        connection.close()
    try:
        return answer.status, json.loads(body)
    except ValueError:  # not the proxy's JSON: say what came back
        return answer.status, {"error": body.decode("ascii", "replace")[:300].strip()}


def main(argv=None) -> int:
    args = parse_args(argv)
    proxy = proxy_url()
    if not proxy:
        sys.stderr.write("corral-request: no HTTP_PROXY in the environment: it works inside "
                         "a corral session, through the session's proxy\n")
        return 2
    try:
        status, answer = ask(args, proxy)
    except (OSError, ValueError, http.client.HTTPException) as exc:
        sys.stderr.write(f"corral-request: cannot reach the session's proxy {proxy}: {exc}\n")
        return 2
    if args.json:
        sys.stdout.write(json.dumps({"http_status": status, **answer}) + "\n")
    if status == 429:
        if not args.json:
            sys.stderr.write(f"corral-request: {answer.get('error', 'asked too often')}\n")
        return 4
    state = answer.get("status")
    if state not in EXIT:
        if not args.json:
            sys.stderr.write(f"corral-request: {answer.get('error') or answer}\n")
        return 2
    if not args.json:
        target = f"{answer.get('kind', args.kind)} {answer.get('target', args.host)}"
        if state == "pending":
            line = (f"pending: approval {answer.get('id')} for {target}; a person decides "
                    f"with `corral approve {answer.get('id')}` or `corral refuse`")
        elif state == "approved":
            line = f"approved ({answer.get('grant')}): {target}"
        elif state == "allowed":
            line = f"allowed already: {target}"
        else:
            line = f"refused: {target}: {answer.get('reason', '')}"
        sys.stdout.write(line + "\n")
    return EXIT[state]


if __name__ == "__main__":
    sys.exit(main())
