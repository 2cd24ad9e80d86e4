"""What a push says before its pack, read as git's receive-pack reads it: the commands, the
capabilities they ask for, and the push options. Sans-IO, standard library only; the one
reading of them for git over HTTP (http.py) and over SSH (sshwire.py).

A push is pkt-lines (4 hex digits of length, then data; `0000` a flush):

    OLD NEW REF\\0CAPABILITIES\\n     a command (the list after NUL: any line may carry one)
    OLD NEW REF\\n
    shallow OID                      (a shallow clone's boundary: no command)
    0000
    OPTION ...                       the push options, when a line asked for them
    0000
    PACK...                          the objects (none for a push that only deletes)

receive-pack (builtin/receive-pack.c, `read_head_info`) reads a capability list on *every*
command line, from its first NUL to the next (a C string), one trailing newline dropped from
the packet first, and sets a feature from whichever line names it. Each feature is looked
up as connect.c's `parse_feature_value` does: a word starting the list or after git's space
(space, tab, newline, carriage return; not \\v or \\f), spelt exactly (case included), ended
by the list's end, git's space, or `=` and a value (the value ends at a space, tab or
newline). So `push-options` on the second line, or `push-options=1`, asks for push options
as much as the bare word on the first; `features` reads a list that way. (git's loop has one
quirk of its own: after a miss, the next match one byte further counts as a word's start;
it only matters for a name of one repeated letter, which no capability is.)

When any line asked for `push-options` (and the server advertises them), receive-pack reads
one pkt-line per option after the commands' flush, up to the next flush, before the pack,
and hands them to its hooks (`GIT_PUSH_OPTION_0`, ...): on GitLab `merge_request.create`
and `merge_request.target=main` open and merge a merge request. corral reads the block
whenever a line asks for it (it cannot know what the server advertises; a server that does
not read the block fails on it as on a bad pack) and judges each option (http.py). An
option git's client would not send (a NUL or another control character; git refuses a
newline in `-o`) or one that is not UTF-8 makes the push unreadable: refused.

Shallow lines are passed over before any list is read, as receive-pack does; a line
`push-cert` (signed pushes) is refused: its commands and options are in the certificate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_COMMANDS = 1000
MAX_OPTIONS = 100
"""Push options read in one push (`git push -o` sends one line per option; none is a limit
of git's): more are refused."""
FLUSH = b"0000"
PKT_LENGTH = re.compile(rb"[0-9a-f]{4}", re.IGNORECASE)
"""Four hex digits, as git's hexval reads them; nothing int() would also take (`+0af`,
` 0af`, `0x1f`)."""
OID = re.compile(rb"[0-9a-f]{40}|[0-9a-f]{64}")
"""An object id as git writes one: SHA-1 or SHA-256, lower-case hex."""
_WORD = re.compile(rb"(?:^|(?<=[ \t\n\r]))[^ \t\n\r=]+")
"""A feature's name: a word at the list's start or after git's space, up to git's space or
`=`."""
_VALUE = re.compile(rb"[^ \t\n]*")
"""A feature's value after `=`: strcspn(value, " \\t\\n") (a carriage return stays in)."""
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
OBJECT_FORMATS = ("sha1", "sha256")


class GitProtocolError(ValueError):
    """A body that is not what git sends; the message says where."""


def pkt(data: bytes) -> bytes:
    return b"%04x" % (len(data) + 4) + data


def pkt_lines(data: bytes, offset: int = 0):
    """(payload or None for a flush, offset after it), until a flush has been yielded."""
    while True:
        if offset + 4 > len(data):
            raise GitProtocolError("the push ends inside its commands (no flush-pkt)")
        head = data[offset : offset + 4]
        if not PKT_LENGTH.fullmatch(head):
            raise GitProtocolError(f"not a pkt-line length at byte {offset}: {bytes(head)!r}")
        length = int(head, 16)
        if length == 0:
            yield None, offset + 4
            return
        if length < 4 or offset + length > len(data):
            raise GitProtocolError(f"a pkt-line of {length} bytes at byte {offset} does not fit")
        yield data[offset + 4 : offset + length], offset + length
        offset += length


def features(listing: bytes) -> dict[str, str]:
    """A capability list (one command line's, from its NUL to the next) as receive-pack reads
    it: each feature's name -> its value ("" for a bare one), the first of a name counting.
    Names and values are the bytes as sent (latin-1: no two byte strings read alike)."""
    found: dict[str, str] = {}
    for word in _WORD.finditer(listing):
        end = word.end()
        value = _VALUE.match(listing, end + 1).group() if listing[end : end + 1] == b"=" else b""
        found.setdefault(word.group().decode("latin-1"), value.decode("latin-1"))
    return found


@dataclass(frozen=True, slots=True)
class Command:
    old: str
    new: str
    ref: str

    @property
    def creates(self) -> bool:
        return set(self.old) == {"0"}

    @property
    def deletes(self) -> bool:
        return set(self.new) == {"0"}


@dataclass(frozen=True, slots=True)
class Push:
    commands: tuple[Command, ...]
    capabilities: frozenset[str]
    """The features any command line asks for, by name (`features`), values aside."""
    pack: int
    """Where the pack starts in the decoded body (its length when there is none)."""
    options: tuple[str, ...] = ()
    """The push options (`git push -o`), in order: judged one by one, passed on only when
    the policy names each."""
    object_format: str | None = None
    """The object format the lists name (sha1 for a list that names none), None when no
    line carries a list."""


def read_push(body: bytes) -> Push:
    """The commands, capabilities and options of a receive-pack request body (decoded).
    Raises GitProtocolError."""
    commands: list[Command] = []
    capabilities: set[str] = set()
    formats: set[str] = set()
    end = 0
    for payload, after in pkt_lines(body):
        end = after
        if payload is None:
            break
        payload = _chomp(payload)
        line, nul, rest = payload.partition(b"\0")
        if len(payload) > 8 and line.startswith(b"shallow "):  # before any list is read
            if not OID.match(line, 8):
                raise GitProtocolError(f"a shallow line that names no object id at byte {end}")
            continue
        if nul:
            listed = features(rest.partition(b"\0")[0])
            capabilities.update(listed)
            formats.add(listed.get("object-format", "sha1"))
        if line.startswith(b"push-cert"):
            raise GitProtocolError("signed pushes (push-cert) are not read by corral; push "
                                   "without --signed")
        commands.append(_command(line, len(commands) + 1))
    if len(formats) > 1:
        raise GitProtocolError("command lines that name different object formats")
    if formats and not formats <= set(OBJECT_FORMATS):
        raise GitProtocolError("a command line names an object format git does not know")
    options: list[str] = []
    if "push-options" in capabilities and commands:
        for payload, after in _option_lines(body, end):
            end = after
            if payload is not None:
                if len(options) >= MAX_OPTIONS:
                    raise GitProtocolError(f"more than {MAX_OPTIONS} push options")
                options.append(_option(_chomp(payload), len(options) + 1))
    return Push(tuple(commands), frozenset(capabilities), end, tuple(options),
                formats.pop() if formats else None)


def _chomp(payload: bytes) -> bytes:
    """One trailing newline off, as git's packet reader drops it (PACKET_READ_CHOMP_NEWLINE)."""
    return payload[:-1] if payload.endswith(b"\n") else payload


def _command(line: bytes, number: int) -> Command:
    parts = line.split(b" ")
    if len(parts) != 3 or not OID.fullmatch(parts[0]) or not OID.fullmatch(parts[1]):
        raise GitProtocolError(f"command {number} is not 'OLD NEW REF'")
    if number > MAX_COMMANDS:
        raise GitProtocolError(f"more than {MAX_COMMANDS} refs in one push")
    try:
        ref = parts[2].decode("utf-8")
    except UnicodeDecodeError:
        raise GitProtocolError(f"command {number}: a ref name that is not UTF-8") from None
    return Command(parts[0].decode(), parts[1].decode(), ref)


def _option_lines(body: bytes, offset: int):
    try:
        yield from pkt_lines(body, offset)
    except GitProtocolError as exc:
        raise GitProtocolError(f"the push options cannot be read: {exc}".replace(
            "inside its commands", "inside its push options")) from None


def _option(payload: bytes, number: int) -> str:
    try:
        option = payload.decode("utf-8")
    except UnicodeDecodeError:
        raise GitProtocolError(f"push option {number} is not UTF-8") from None
    if _CONTROL.search(option):
        raise GitProtocolError(f"push option {number} holds a control character (git sends "
                               "none)")
    return option
