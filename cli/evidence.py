"""`corral evidence SESSION [-o FILE]`: what a session did and was allowed, in one signed
archive; `corral evidence --verify FILE [--key PEM]`: check one offline.

The archive is a plain tar, the same bytes for the same answer: members in name order, each
with mode 0644, owner 0, time 0. It holds the members the appliance assembled
(appliance/api/evidence.py says what each is), `index.json` (the session, the signed head
the records run to, each member's sha256) and `signature.json` (the appliance's Ed25519
signature over the index, behind the evidence prefix of appliance/pki/signed.py), both
canonical JSON. Verification uses the key pinned on this host, or --key: never a key the
bundle brings.

Verification refuses a bundle (naming the member) when: the index's signature does not
verify with the key; a member is missing, extra, or not what the index says (sha256);
audit.jsonl's records do not form one chain; a signed head in heads.jsonl does not verify;
or the chain does not end at a signed head (the head the index names).
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

from appliance.pki import signed
from appliance.pki.signed import read_heads

from . import exitcodes, files, heads, output
from .arguments import appliance_command
from .client import SLOW, CliError, config_home, load_appliance
from .client import Client as ApiClient

INDEX, SIGNATURE = "index.json", "signature.json"


class Refused(CliError):
    """A bundle that does not check out; `member` names the part at fault."""

    def __init__(self, member: str, message: str):
        super().__init__(f"{member}: {message}", "the bundle was changed after the appliance "
                         "signed it (or was never its): ask for a new one with `corral "
                         "evidence SESSION`", exitcodes.AUDIT_BROKEN)
        self.member = member


def archive(members: dict[str, bytes]) -> bytes:
    """A deterministic tar of `members`."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in sorted(members):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(members[name]), 0o644, 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(members[name]))
    return buffer.getvalue()


def bundle(answer: dict) -> bytes:
    """The archive for the API's answer (GET /sessions/NAME/evidence)."""
    members = {name: text.encode() for name, text in answer["members"].items()}
    members[INDEX] = signed.canonical(answer["index"])
    members[SIGNATURE] = signed.canonical({"signature": answer["signature"]})
    return archive(members)


def unpack(data: bytes) -> dict[str, bytes]:
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            members: dict[str, bytes] = {}
            for info in tar.getmembers():
                if not info.isfile() or "/" in info.name or info.name in members:
                    raise Refused(info.name, "not a plain file at the top of the archive, or "
                                  "there twice")
                members[info.name] = tar.extractfile(info).read()
    except (tarfile.TarError, EOFError) as exc:
        raise Refused("the archive", f"not a tar archive ({exc})") from None
    return members


def _json(members: dict[str, bytes], name: str):
    """A member that must be canonical JSON (so that no byte of it can change unseen)."""
    if name not in members:
        raise Refused(name, "missing")
    try:
        value = json.loads(members[name])
    except ValueError as exc:
        raise Refused(name, f"not JSON ({exc})") from None
    if signed.canonical(value) != members[name]:
        raise Refused(name, "not in canonical form (keys sorted, no spaces): changed")
    return value


def check(data: bytes, key, kept: list[dict] = ()) -> dict:
    """Check a bundle with the appliance's public key; what it holds, or Refused. `kept`:
    the heads this host kept for that appliance: root on the appliance holds the key and
    could sign a bundle of a rewritten log, but not change what this host kept before."""
    members = unpack(data)
    index = _json(members, INDEX)
    signature = _json(members, SIGNATURE)
    try:
        signed.check_evidence(key, index, signature.get("signature")
                              if isinstance(signature, dict) else None)
    except signed.SignatureError as exc:
        raise Refused(INDEX, f"{exc} (the index or {SIGNATURE} was changed)") from None
    listed = index["members"]
    for name, digest in sorted(listed.items()):
        if name not in members:
            raise Refused(name, "missing (the index lists it)")
        actual = hashlib.sha256(members[name]).hexdigest()
        if actual != digest:
            raise Refused(name, f"its sha256 is {actual}, the signed index says {digest}")
    extra = sorted(set(members) - set(listed) - {INDEX, SIGNATURE})
    if extra:
        raise Refused(extra[0], "not in the signed index")
    records = _chain(members, index, key, kept)
    return {"ok": True, "session": index["session"], "appliance": index.get("appliance"),
            "created": index.get("created"), "members": sorted(listed),
            "records": records, "head": index.get("head"), "key": signed.fingerprint(key)}


def _chain(members: dict[str, bytes], index: dict, key, kept: list[dict] = ()) -> dict:
    """audit.jsonl is one chain that ends at a head the appliance signed (heads.jsonl), and
    holds at each seq a head kept on this host the record that head names."""
    kept_here = {h["seq"]: h for h in kept}
    matched = 0
    head = index.get("head") or {}
    signed_heads = {}
    for number, raw in enumerate(members.get("heads.jsonl", b"").splitlines(), 1):
        try:
            found = json.loads(raw)
            signed.check_head(key, found)
        except (ValueError, signed.SignatureError) as exc:
            raise Refused("heads.jsonl", f"line {number}: {exc}") from None
        signed_heads[found["seq"]] = found
    seq = digest = None
    session = 0
    lines = members.get("audit.jsonl", b"").splitlines()
    if not lines:
        raise Refused("audit.jsonl", "no records")
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            raise Refused("audit.jsonl", f"line {number} is not an audit record") from None
        if seq is not None and (record.get("seq") != seq + 1 or record.get("prev") != digest):
            raise Refused("audit.jsonl", f"line {number} (seq {record.get('seq')}) does not "
                          f"follow the record before it (seq {seq}): the chain is broken")
        seq, digest = record.get("seq"), signed.line_hash(line)
        session += record.get("session") == index["session"]
        at = signed_heads.get(seq)
        if at is not None and at["hash"] != digest:
            raise Refused("audit.jsonl", f"the record at seq {seq} is not the one the "
                          "appliance signed a head for (heads.jsonl)")
        here = kept_here.get(seq)
        if here is not None:
            if here["hash"] != digest:
                raise Refused("audit.jsonl", f"the record at seq {seq} is not the one the "
                              "appliance signed the head this host kept for it: the log was "
                              "rewritten before the bundle was made")
            matched += 1
    end = signed_heads.get(seq)
    if end is None or head != {"seq": seq, "hash": digest}:
        raise Refused("audit.jsonl", f"the records end at seq {seq}, which is not the signed "
                      f"head the index names ({head.get('seq')}): the chain is not anchored")
    first = json.loads(lines[0]).get("seq")
    return {"first": first, "last": seq, "session": session, "heads": len(signed_heads),
            "kept_heads_matched": matched}


def cmd_evidence(args) -> int:
    if args.verify:
        return _verify(args)
    if not args.session:
        raise CliError("which session? name it: `corral evidence SESSION`",
                       "or check a bundle: `corral evidence --verify FILE`", exitcodes.USAGE)
    appliance = load_appliance(args.appliance)
    client = ApiClient(appliance)
    heads.keep(client, appliance)  # pins the key on first sight, keeps the newest heads
    key = heads.pinned_key(appliance, client.request("GET", "/audit/key")["key"])
    answer = client.request("GET", f"/sessions/{args.session}/evidence", timeout=SLOW)
    data = bundle(answer)
    verdict = check(data, key, heads.kept(appliance))  # never write what would not verify
    target = Path(args.output or f"corral-evidence-{args.session}.tar")
    files.replace(target, data)
    summary = {"file": str(target), "sha256": hashlib.sha256(data).hexdigest(), **verdict}
    if args.json:
        output.data(summary)
    else:
        records = verdict["records"]
        output.line(f"wrote {target}: session {args.session}, {len(verdict['members'])} "
                    f"members, audit records seq {records['first']} to {records['last']} "
                    f"({records['session']} of the session's), ending at the head signed at "
                    f"seq {records['last']} (key {verdict['key']})")
    return exitcodes.OK


def _key(args):
    if args.key:
        try:
            return signed.load_public(Path(args.key).read_bytes(), args.key)
        except OSError as exc:
            raise CliError(f"cannot read --key {args.key}: {exc.strerror}",
                           code=exitcodes.USAGE) from None
        except signed.SignatureError as exc:
            raise CliError(str(exc), "pass the appliance's head-key.pub (PEM)",
                           exitcodes.USAGE) from None
    pinned = config_home() / "appliances" / args.appliance / heads.PINNED
    if not pinned.exists():
        raise CliError(f"no key pinned for appliance {args.appliance} ({pinned})",
                       "pass --key FILE (the appliance's head-key.pub, from its filter's "
                       "state directory), or run `corral audit` once to pin it",
                       exitcodes.USAGE)
    return signed.load_public(pinned.read_bytes(), str(pinned))


def _verify(args) -> int:
    key = _key(args)
    # with the pinned key, the heads kept beside it are checked too (offline, --key: only
    # the signature vouches, and a key holder can sign anything)
    kept = [] if args.key else list(read_heads(
        config_home() / "appliances" / args.appliance / heads.KEPT))
    try:
        data = Path(args.verify).read_bytes()
    except OSError as exc:
        raise CliError(f"cannot read {args.verify}: {exc.strerror}",
                       code=exitcodes.USAGE) from None
    try:
        verdict = check(data, key, kept)
    except Refused as exc:
        if args.json:
            output.data({"ok": False, "member": exc.member, "error": str(exc)})
            return exc.code
        raise
    if args.json:
        output.data(verdict)
    else:
        records = verdict["records"]
        output.line(f"{args.verify}: verified with key {verdict['key']}: session "
                    f"{verdict['session']} on {verdict['appliance']}, "
                    f"{len(verdict['members'])} members as signed, audit records seq "
                    f"{records['first']} to {records['last']} chained to the head signed at "
                    f"seq {records['last']}")
    return exitcodes.OK


def register(sub) -> None:
    command = appliance_command(
        sub, "evidence", "a session's signed evidence bundle, or check one offline",
        cmd_evidence, session=False, description=(
            "Write one archive with the session's effective policy by layer, every approval "
            "and grant with who decided, its events and audit records chained to a head "
            "the appliance signed, the manifest's digest, and an index of it all signed by "
            "the appliance; or, with --verify, check such an archive offline."))
    command.add_argument("session", nargs="?", metavar="SESSION")
    command.add_argument("-o", "--output", metavar="FILE",
                         help="where to write it (default: corral-evidence-SESSION.tar)")
    command.add_argument("--verify", metavar="FILE", help="check a bundle offline "
                         "(exit 5 if refused)")
    command.add_argument("--key", metavar="PEM", help="with --verify: the appliance's "
                         "public key (default: the one pinned for --appliance)")
