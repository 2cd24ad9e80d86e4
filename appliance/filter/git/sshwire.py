"""git over SSH, read by the appliance's gateway: which repository an exec channel reaches
and where a push sent on it ends. Sans-IO, standard library only; the rules are git over
HTTP's (http.py judges the push, policy/git.py holds the rules).

OpenSSH's git client asks for one command on its exec channel, the path quoted as git's
sq_quote writes it (`'`, and `'\\''` or `'\\!'` for a quote or a `!` inside):

    git-receive-pack 'acme/widget.git'      push
    git-upload-pack '/acme/widget.git'      fetch
    git-upload-archive 'acme/widget'        git archive --remote

`read_exec` reads exactly that grammar (and `git receive-pack ...`, which some clients send)
and refuses everything else: the gateway runs no shell, so nothing else may pass as one.

A push on SSH has no length: the body is the client's stream. `PushStream` is fed what the
client sends and says when the push is whole (commands, options, the pack and its trailer;
the commands and options read by protocol.read_push, as over HTTP),
so the gateway can judge it before any of it reaches the upstream. Whole means the pack's
trailer is read: git closes its side after the pack, but a delete-only push ends with its
commands, and the client then waits for the report with the channel open.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from dataclasses import dataclass

from appliance.filter.git import http as git
from appliance.filter.git import pack as packs
from appliance.filter.git.protocol import PKT_LENGTH, GitProtocolError, read_push

MAX_COMMAND = 4096
MAX_PATH = 1024
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_SEGMENT = re.compile(r"[A-Za-z0-9._~-]+")
"""A repository path's segment: policy/git.py's repository characters, less its glob."""
_KINDS = (packs.COMMIT, packs.TREE, packs.BLOB, packs.TAG, packs.OFS_DELTA, packs.REF_DELTA)
_FIRST_PIECE = 64
"""What an object's inflater is fed first; each later piece is as long as all before it
(up to packs.STEP). zlib hands back what follows a stream's end as a copy: small first pieces
keep that copy proportional to the object (a million tiny objects fed 64 KiB each would
copy 64 GB)."""


@dataclass(frozen=True, slots=True)
class SshCall:
    """An exec channel's git command: the service it asks for and the repository."""

    service: str
    repo: str


def read_exec(command: str) -> SshCall:
    """The git call of an exec request's command. Raises GitProtocolError naming what is
    not git's."""
    if len(command) > MAX_COMMAND:
        raise GitProtocolError(f"an exec command longer than {MAX_COMMAND} characters")
    if _CONTROL.search(command):
        raise GitProtocolError("a control character in the exec command")
    word, _, argument = command.partition(" ")
    if word == "git":  # `git receive-pack 'x'`: the same service, as a subcommand
        sub, _, argument = argument.partition(" ")
        word = "git-" + sub
    if word not in git.SERVICES:
        raise GitProtocolError(f"not a git command: {command[:60]!r} (only "
                               f"{', '.join(git.SERVICES)} with one quoted path)")
    if not argument:
        raise GitProtocolError(f"{word} names no repository")
    path = _unquote(argument)
    if len(path) > MAX_PATH:
        raise GitProtocolError(f"a repository path longer than {MAX_PATH} characters")
    repo = path[1:] if path.startswith("/") else path
    repo = repo[:-1] if repo.endswith("/") else repo
    repo = repo[:-4] if repo.lower().endswith(".git") else repo
    for segment in repo.split("/"):
        if segment in ("", ".", ".."):
            raise GitProtocolError(f"the repository path {path[:100]!r} has an empty, '.' or "
                                   "'..' segment")
        if segment[0] in "~-":
            # `~user/x` is another user's home on a git-shell server (a `*` matched it), and
            # a leading `-` reads as an option to the host's git-upload-pack
            raise GitProtocolError(f"the repository path {path[:100]!r}: segment "
                                   f"{segment[:40]!r} starts with {segment[0]!r}; name the "
                                   "repository from the host's root (OWNER/REPO)")
        if not _SEGMENT.fullmatch(segment):
            # what a [[git]] pattern can name, and what the gateway quotes again for the
            # host's shell: a quote, `;` or `$` in a path a glob matched would run there
            raise GitProtocolError(f"the repository path {path[:100]!r}: segment "
                                   f"{segment[:40]!r} holds a character a repository name "
                                   "does not (letters, digits, '.', '_', '-', '~')")
    return SshCall(word, repo)


def _unquote(argument: str) -> str:
    """One argument as git's sq_quote writes it: quoted runs, joined by `\\'` or `\\!`."""
    parts, pos = [], 0
    while True:
        if not argument.startswith("'", pos):
            raise GitProtocolError("the repository path is not single-quoted as git quotes it")
        end = argument.find("'", pos + 1)
        if end < 0:
            raise GitProtocolError("unbalanced quotes in the repository path")
        parts.append(argument[pos + 1 : end])
        pos = end + 1
        if argument[pos : pos + 2] in ("\\'", "\\!"):
            parts.append(argument[pos + 1])
            pos += 2
        elif pos == len(argument):
            return "".join(parts)
        else:
            raise GitProtocolError("more than one argument after the git command")


class PushStream:
    """The bytes a client sends on a git-receive-pack channel, read as they come, up to the
    end of the push. Each `feed` works on the bytes it is given (and a few held over): the
    commands are read once, the pack object by object, its trailer hashed along the way."""

    def __init__(self) -> None:
        self._data = bytearray()
        self._pos = 0  # where reading goes on (in an object: where its zlib data starts)
        self._stage = "commands"
        self._push: git.Push | None = None
        self._digest = hashlib.sha1(usedforsecurity=False)  # git's ids: sha256 when asked
        self._hashed = self._count = self._index = 0
        self._budget = packs.InflateBudget(packs.MAX_INFLATED)
        self._inflater = zlib.decompressobj()
        self._fed = self._size = self._inflated = 0  # of the object being inflated

    @property
    def complete(self) -> bool:
        return self._stage == "done"

    @property
    def push(self) -> git.Push | None:
        """The commands and capabilities, once read (a refusal answers in their form)."""
        return self._push

    @property
    def body(self) -> bytes:
        """The push as the client sent it, commands to trailer: what `git.judge` reads."""
        if not self.complete:
            raise RuntimeError("the push is not whole yet")
        return bytes(self._data)

    def feed(self, data: bytes) -> bool:
        """Take the next bytes the client sent; True once the push is whole. Raises
        GitProtocolError for what git does not send, or sends no more of."""
        if len(self._data) + len(data) > git.MAX_PUSH:
            raise GitProtocolError(f"a push larger than {git.MAX_PUSH >> 20} MiB")
        self._data += data
        try:
            while not self.complete and self._step():
                pass
        except zlib.error as exc:
            raise GitProtocolError(f"the pack holds data that does not inflate: {exc}") from None
        if self.complete and self._pos < len(self._data):
            after = "the pack's trailer" if self._push.pack < self._pos else "the commands"
            raise GitProtocolError(f"{len(self._data) - self._pos} bytes after {after}")
        return self.complete

    def feed_eof(self) -> None:
        """The client closed its side: raises GitProtocolError unless the push is whole."""
        if self.complete:
            return
        where = {"commands": "inside its commands (no flush-pkt)",
                 "options": "inside its push options (no flush-pkt)",
                 "header": "before the pack's header",
                 "trailer": "inside the pack's trailer"}.get(
            self._stage, f"inside object {self._index + 1} of {self._count} of the pack")
        raise GitProtocolError(f"the client ended the push {where}, at byte {len(self._data)}")

    def _step(self) -> bool:
        """Read on as far as the next boundary; False when more bytes are needed."""
        if self._stage in ("commands", "options"):
            return self._pkt_line()
        if self._stage == "header":
            return self._header()
        if self._stage == "object":
            return self._object_header()
        if self._stage == "data":
            return self._inflate()
        return self._trailer()

    def _pkt_line(self) -> bool:
        head = bytes(self._data[self._pos : self._pos + 4])
        if len(head) < 4:
            return False
        if not PKT_LENGTH.fullmatch(head):
            raise GitProtocolError(f"not a pkt-line length at byte {self._pos}: {head!r}")
        length = int(head, 16)
        if 0 < length < 4:
            raise GitProtocolError(f"a pkt-line length of {length} at byte {self._pos}")
        if len(self._data) < self._pos + max(length, 4):
            return False
        self._pos += max(length, 4)
        if length == 0:
            self._section_read()
        return True

    def _section_read(self) -> None:
        """A flush: the commands (or their options) end here. What comes next is for
        read_push to say, not a second reading of its rules: it reads options after the
        commands when their capabilities ask for them, so options are due when it reads
        past a flush put after the commands."""
        section = bytes(self._data[: self._pos])
        if self._stage == "commands" and read_push(section + git.FLUSH).pack > len(section):
            self._stage = "options"
            return
        push = self._push = read_push(section)
        if not push.commands or all(c.deletes for c in push.commands):
            self._stage = "done"  # git sends no pack for these
            return
        sha256 = (push.object_format == "sha256"
                  or any(len(c.new) == 64 for c in push.commands))
        self._digest = hashlib.new("sha256" if sha256 else "sha1", usedforsecurity=False)
        self._hashed = self._pos
        self._stage = "header"

    def _header(self) -> bool:
        if len(self._data) < self._pos + 12:
            return False
        header = bytes(self._data[self._pos : self._pos + 12])
        if header[:4] != b"PACK" or header[4:8] not in (b"\0\0\0\2", b"\0\0\0\3"):
            raise GitProtocolError("the push's pack does not start with a pack header")
        self._count = int.from_bytes(header[8:], "big")
        if self._count > packs.MAX_OBJECTS:
            raise GitProtocolError(f"a pack of {self._count} objects; corral reads at most "
                                   f"{packs.MAX_OBJECTS}")
        self._pos += 12
        self._stage = "object" if self._count else "trailer"
        return True

    def _object_header(self) -> bool:
        """The next object's type and size, and its base; False until they are all here."""
        try:
            kind, size, pos = packs._varint_header(self._data, self._pos)
            if kind not in _KINDS:
                raise GitProtocolError(f"an object of unknown type {kind} in the pack")
            if kind == packs.OFS_DELTA:
                for length in range(1, 11):  # as iter_commits reads it
                    if not self._data[pos + length - 1] & 0x80:
                        break
                else:
                    raise GitProtocolError("a delta offset longer than git writes")
                pos += length
            elif kind == packs.REF_DELTA:
                pos += self._digest.digest_size  # the base's id
        except IndexError:
            return False
        if pos > len(self._data):
            return False
        self._pos = self._fed = pos
        self._size, self._inflated = size, 0
        self._inflater = zlib.decompressobj()
        self._stage = "data"
        return True

    def _inflate(self) -> bool:
        """Feed this object's zlib data to its inflater and throw away what comes out (a
        step at a time: a zlib bomb costs CPU, never memory). Its end is where zlib's stream
        ends."""
        inflater = self._inflater
        while self._fed < len(self._data):
            length = min(packs.STEP, max(_FIRST_PIECE, self._fed - self._pos))
            piece = bytes(self._data[self._fed : self._fed + length])
            self._fed += len(piece)
            while True:
                out = len(inflater.decompress(piece, packs.STEP))
                self._inflated += out
                if self._inflated > self._size:
                    raise GitProtocolError("an object inflates past the size it declares")
                self._budget.spend(out)
                piece = inflater.unconsumed_tail
                if inflater.eof or (not piece and out < packs.STEP):
                    break
            if inflater.eof:
                if self._inflated != self._size:
                    raise GitProtocolError("an object inflates to less than the size it "
                                           "declares")
                self._pos = self._fed - len(inflater.unused_data)
                self._digest.update(self._data[self._hashed : self._pos])
                self._hashed, self._index = self._pos, self._index + 1
                self._stage = "trailer" if self._index == self._count else "object"
                return True
        return False

    def _trailer(self) -> bool:
        end = self._pos + self._digest.digest_size
        if len(self._data) < end:
            return False
        self._digest.update(self._data[self._hashed : self._pos])
        if self._data[self._pos : end] != self._digest.digest():
            raise GitProtocolError(f"the pack's trailer is not the {self._digest.name} of the "
                                   "pack")
        self._pos, self._stage = end, "done"
        return True
