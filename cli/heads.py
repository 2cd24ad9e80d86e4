"""The appliance's signed audit heads, kept on this host: what makes a rewrite of the whole
audit log visible from outside (appliance/filter/audit/heads.py says why).

Per appliance, in its directory (`corral` writes nothing else there):
  audit-key.pem        the audit key's public half, pinned on first sight (like SSH's
                       known_hosts): a different key later is an error that names the fix
  audit-heads.jsonl    every signed head seen, oldest first, append-only: each batch of new
                       heads is one write(2) of whole lines with O_APPEND, fsynced; a torn
                       last line (a crash mid-write) is cut before the next append

`corral audit` and `corral status` keep the heads signed since the last one kept (`keep`);
`corral audit --verify` checks each kept head (`verify`): its signature with the pinned
key, and that the log still holds, at its seq, the record with its hash, the records
between kept heads linked by the chain.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

from appliance.pki import signed
from appliance.pki.signed import cut_torn_tail, read_heads

from . import exitcodes, files
from .client import Appliance, Client, CliError

KEPT = "audit-heads.jsonl"
PINNED = "audit-key.pem"
PAGE = 1000


class LogRewritten(CliError):
    """The log no longer holds the record a kept head names: new heads are not kept (they
    would vouch for whatever replaced it)."""

    def __init__(self, message: str, seq: int):
        super().__init__(message, "if this host did not look for longer than the appliance "
                         "keeps its log, retention removed it: move audit-heads.jsonl aside "
                         "to keep heads anew; otherwise the log was rewritten: keep the "
                         "appliance as it is and look", exitcodes.AUDIT_BROKEN)
        self.seq = seq


class KeyChanged(CliError):
    pass


def pinned_key(appliance: Appliance, served: str):
    """The pinned key (pinning `served` if none is): KeyChanged if `served` differs."""
    path = appliance.directory / PINNED
    if path.exists():
        pinned = path.read_text()
        if pinned.strip() != served.strip():
            new = signed.fingerprint(signed.load_public(served, "the served key"))
            old = signed.fingerprint(signed.load_public(pinned, str(path)))
            raise KeyChanged(
                f"appliance {appliance.name}'s audit key changed: pinned {old}, it now "
                f"serves {new}. Either it was re-provisioned (a new key), or someone replaced "
                "the key to sign a rewritten log",
                f"if you re-provisioned it, check that {new} is the filter's key on the "
                "appliance (head-key.pub in its state directory), then move "
                f"{path} and {path.with_name(KEPT)} aside to pin the new one",
                exitcodes.AUDIT_BROKEN)
    else:
        files.replace(path, served.encode())
    return signed.load_public(path.read_text(), str(path))


def kept(appliance: Appliance) -> list[dict]:
    """The heads kept here, oldest first (a torn or foreign line is skipped: every kept head
    is checked against the pinned key before it counts)."""
    return list(read_heads(appliance.directory / KEPT))


def _append(appliance: Appliance, heads: list[dict]) -> None:
    data = b"".join(signed.canonical(h) + b"\n" for h in heads)
    fd = os.open(appliance.directory / KEPT, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        cut_torn_tail(fd)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _keeping(appliance: Appliance):
    """One `keep` at a time per appliance (the dashboard's threads, `corral status` beside
    it): read-then-append would keep the same heads twice."""
    fd = os.open(appliance.directory / f"{KEPT}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def keep(client: Client, appliance: Appliance) -> dict:
    """Fetch the heads signed since the last one kept, check each against the pinned key,
    keep them. What was kept: {"kept", "new", "key"}."""
    with _keeping(appliance):
        return _keep(client, appliance)


def _keep(client: Client, appliance: Appliance) -> dict:
    served = client.request("GET", "/audit/key")
    key = pinned_key(appliance, served["key"])
    heads = kept(appliance)
    since = heads[-1]["seq"] if heads else 0
    new: list[dict] = []
    while True:
        page = client.request("GET", "/audit/heads", since=since, limit=PAGE)
        for head in page["heads"]:
            try:
                signed.check_head(key, head)
            except signed.SignatureError as exc:
                raise CliError(f"appliance {appliance.name} served a bad signed head: {exc}",
                               "nothing was kept; run `corral audit --verify`",
                               exitcodes.AUDIT_BROKEN) from None
            if head["seq"] > since:
                new.append(head)
                since = head["seq"]
        if not page.get("more") or not page["heads"]:
            break
    if new and heads:
        _still_holds(client, heads[-1])
    if new:
        _append(appliance, new)
    return {"kept": len(heads) + len(new), "new": len(new), "key": signed.fingerprint(key)}


def _still_holds(client: Client, head: dict) -> None:
    """The log still holds, at the newest kept head's seq, the record it names. Without
    this, root could replace the log with a consistent chain that starts after that head,
    and the heads the filter signs for it from then on would be kept as if they followed."""
    page = client.request("GET", "/audit", after=head["seq"] - 1, limit=1)
    records = page["records"]
    if not records or records[0]["seq"] != head["seq"]:
        raise LogRewritten(
            f"the log no longer holds the record at seq {head['seq']}, for which this host "
            "kept a signed head (it now starts at seq "
            f"{records[0]['seq'] if records else 'none'}): new heads were not kept",
            head["seq"])
    if signed.line_hash(signed.canonical(records[0])) != head["hash"]:
        raise LogRewritten(
            f"the log's record at seq {head['seq']} is not the one the appliance signed the "
            "head this host kept for: the log was rewritten; new heads were not kept",
            head["seq"])


def verify(client: Client, appliance: Appliance) -> dict:
    """Check every kept head: its signature, and the log's record at its seq (the records
    between the first and the last kept head walked as a chain). A verdict: `intact`, and
    where it broke (`seq`, `error`)."""
    try:
        keep(client, appliance)
        refused = None
    except LogRewritten as exc:  # the heads kept before are walked below: the first to
        refused = exc            # fail is the most precise report of where
    key = pinned_key(appliance, client.request("GET", "/audit/key")["key"])
    heads = kept(appliance)
    verdict = {"intact": True, "kept": len(heads), "checked": 0, "retired": 0,
               "key": signed.fingerprint(key), "error": "", "seq": None}
    for head in heads:
        try:
            signed.check_head(key, head)
        except signed.SignatureError as exc:
            return {**verdict, "intact": False, "seq": head.get("seq"),
                    "error": f"kept head: {exc}"}
    if not heads:
        return verdict
    walked = _walk(client, heads, verdict)
    if walked["intact"] and refused is not None:
        return {**walked, "intact": False, "seq": refused.seq, "error": str(refused)}
    return walked


def _walk(client: Client, heads: list[dict], verdict: dict) -> dict:
    """Page through the log from the first kept head's seq to the last's, checking each
    link and each kept head's hash on the way."""
    wanted = {h["seq"]: h for h in heads}
    last = max(wanted)
    after, seq, digest = min(wanted) - 1, None, None
    while seq is None or seq < last:
        page = client.request("GET", "/audit", after=after, limit=PAGE)
        if not page["records"]:
            break
        for record in page["records"]:
            line = signed.canonical(record)
            if seq is None:
                retired = [s for s in wanted if s < record["seq"]]
                verdict["retired"] = len(retired)
            elif record["seq"] != seq + 1 or record.get("prev") != digest:
                return {**verdict, "intact": False, "seq": record["seq"], "error": (
                    f"the log's record at seq {record['seq']} does not follow the one at seq "
                    f"{seq} (a line removed, inserted or edited between kept heads)")}
            seq, digest = record["seq"], signed.line_hash(line)
            head = wanted.get(seq)
            if head is not None:
                if digest != head["hash"]:
                    return {**verdict, "intact": False, "seq": seq, "error": (
                        f"the log's record at seq {seq} is not the one the appliance signed "
                        f"at {head['time']}: its hash is {digest[:16]}..., the kept head "
                        f"says {head['hash'][:16]}...: the log was rewritten from there or "
                        "before")}
                verdict["checked"] += 1
            if seq >= last:
                break
        after = seq
    if seq is None or seq < last:
        return {**verdict, "intact": False, "seq": last, "error": (
            f"the log ends at seq {seq or 0} but a head was signed at seq {last}: records "
            "were cut from its end")}
    if verdict["checked"] == 0:
        # Every kept head is older than the log's first record. Retention can do that, but
        # so can root replacing the whole log with a consistent new chain that starts after
        # the last head kept here: with no kept head left in it, nothing vouches for it.
        return {**verdict, "intact": False, "seq": last, "error": (
            f"no head kept on this host is in the log any more (the last was signed at seq "
            f"{last}; the log now starts after it): a log replaced whole cannot be told from "
            "one trimmed by retention, so it cannot be vouched for. Keep heads more often "
            "than retention removes segments (`corral audit` or `corral status` keeps them)")}
    return verdict
