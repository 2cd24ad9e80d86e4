"""git over SSH as the gateway reads it, without sockets: the exec commands real git asks
for, and where the pushes real `git push` sends over SSH end (captured by a GIT_SSH_COMMAND
that tees the client's bytes to a file and runs git-receive-pack on a local bare repository),
then hostile streams."""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path

import pytest

from appliance.filter.git import http as git
from appliance.filter.git import pack as packs
from appliance.filter.git import sshwire
from appliance.filter.git.sshwire import PushStream, SshCall, read_exec
from appliance.policy.git import GitSpec

SPEC = GitSpec.parse("acme/widget")
WORK = "refs/heads/corral/s1/work"

TEE = """\
import os, shlex, subprocess, sys
command = sys.argv[-1]  # the exec command; before it, the host
capture = os.environ["CAPTURE"]
with open(capture + ".command", "w") as f:
    f.write(command)
service, path = shlex.split(command)
child = subprocess.Popen(["git", service.removeprefix("git-"), path], stdin=subprocess.PIPE)
with open(capture + ".stdin", "wb") as log:
    while data := os.read(0, 65536):
        log.write(data)
        child.stdin.write(data)
        child.stdin.flush()
child.stdin.close()
sys.exit(child.wait())
"""


class Client:
    """A work tree that pushes to bare repositories over a captured "SSH"."""

    def __init__(self, root, object_format: str = "sha1"):
        self.root, self.capture = root / "work", str(root / "capture")
        tee = root / "tee.py"
        tee.write_text(TEE)
        self.env = {"PATH": os.environ["PATH"], "HOME": str(root), "GIT_CONFIG_NOSYSTEM": "1",
                    "GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@b",
                    "GIT_COMMITTER_NAME": "a", "GIT_COMMITTER_EMAIL": "a@b",
                    "GIT_SSH_VARIANT": "simple", "CAPTURE": self.capture,
                    "GIT_SSH_COMMAND": f"{shlex.quote(sys.executable)} {shlex.quote(str(tee))}"}
        self.git("init", "-q", "-b", "main", f"--object-format={object_format}", str(self.root))
        self.bare = self.repository("remote.git", object_format)

    def git(self, *args: str) -> str:
        return subprocess.run(["git", *args], cwd=self.root if self.root.exists() else None,
                              env=self.env, capture_output=True, check=True,
                              text=True).stdout.strip()

    def repository(self, name: str, object_format: str = "sha1") -> str:
        path = str(self.root.parent / name)
        self.git("init", "-q", "--bare", f"--object-format={object_format}", path)
        self.git("-C", path, "config", "receive.advertisePushOptions", "true")
        return path

    def commit(self, text: str) -> str:
        (self.root / "f").write_text(text * 40)
        self.git("add", "f")
        self.git("commit", "-q", "-m", text)
        return self.git("rev-parse", "HEAD")

    def push(self, *args: str, to: str | None = None) -> tuple[str, bytes]:
        """The exec command and the bytes `git push` sent on the channel."""
        self.git("push", "-q", f"h:{to or self.bare}", *args)
        with open(self.capture + ".command") as command, open(self.capture + ".stdin",
                                                               "rb") as sent:
            return command.read(), sent.read()


@pytest.fixture(scope="module")
def pushes(tmp_path_factory) -> dict[str, tuple[str, bytes]]:
    client = Client(tmp_path_factory.mktemp("sha1"))
    for text in ("base", "one", "two"):
        client.commit(text)
    sent = {"new": client.push(f"HEAD:{WORK}")}
    client.commit("three")
    client.commit("four")
    sent["forward"] = client.push(f"HEAD:{WORK}")
    sent["existing"] = client.push("HEAD~1:refs/heads/corral/s1/old")  # objects it has
    client.commit("five")
    sent["options"] = client.push("-o", "ci.skip", "-o", "x=y", f"HEAD:{WORK}")
    client.git("reset", "-q", "--hard", "HEAD~3")
    client.commit("rewritten")
    sent["force"] = client.push("-f", f"HEAD:{WORK}")
    sent["delete"] = client.push(":refs/heads/corral/s1/old")
    sent["nothing"] = client.push(f"HEAD:{WORK}")  # up to date
    sent["quoted"] = client.push(f"HEAD:{WORK}", to=client.repository("it's!x.git"))
    try:
        sha256 = Client(tmp_path_factory.mktemp("sha256"), "sha256")
    except subprocess.CalledProcessError:  # a git without sha256 repositories
        return sent
    sha256.commit("base")
    sha256.commit("one")
    sent["sha256-new"] = sha256.push(f"HEAD:{WORK}")
    sha256.commit("two")
    sent["sha256-forward"] = sha256.push(f"HEAD:{WORK}")
    return sent


ALLOWED = ("new", "forward", "existing", "nothing", "quoted", "sha256-new", "sha256-forward")
"""Pushes judge() lets through; "options" is whole too, and refused (git push -o)."""


@pytest.mark.parametrize("name", [*ALLOWED, "options", "force", "delete"])
def test_a_push_git_sends_is_whole_at_its_last_byte_however_it_arrives(pushes, name):
    if name not in pushes:
        pytest.skip("this git makes no sha256 repositories")
    sent = pushes[name][1]
    whole = PushStream()
    assert whole.feed(sent) and whole.body == sent
    byte_by_byte = PushStream()
    assert not any(byte_by_byte.feed(sent[i : i + 1]) for i in range(len(sent) - 1))
    assert byte_by_byte.feed(sent[-1:]) and byte_by_byte.body == sent
    byte_by_byte.feed_eof()  # closing after a whole push is fine
    verdict = git.judge(whole.body, SPEC, "s1")
    assert verdict.allowed == (name in ALLOWED), verdict.reason if not verdict.allowed else name


def test_what_each_push_holds(pushes):
    assert pushes["nothing"][1] == git.FLUSH  # up to date: a lone flush, no pack
    delete = pushes["delete"][1]  # its commands and a flush, no pack
    assert b" " + b"0" * 40 + b" refs/heads/corral/s1/old\0" in delete
    assert delete.endswith(b"0000") and b"PACK" not in delete
    assert b"ci.skip" in pushes["options"][1] and b"push-options" in pushes["options"][1]
    existing = pushes["existing"][1]  # nothing new to send is still a pack, of no objects
    assert existing[existing.index(b"PACK") :][8:12] == b"\0\0\0\0"
    force = git.judge(pushes["force"][1], SPEC, "s1")
    assert "only move a ref forward" in force.reason
    assert "never delete" in git.judge(pushes["delete"][1], SPEC, "s1").reason
    if "sha256-new" in pushes:
        assert b"object-format=sha256" in pushes["sha256-new"][1]


def test_the_exec_commands_git_asks_for(pushes):
    command, _ = pushes["quoted"]
    assert command.endswith("/it'\\''s'\\!'x.git'")  # git's sq_quote, as sent
    # read as git quotes it, and refused for what it holds: no repository name has a quote
    with pytest.raises(git.GitProtocolError, match="a character a repository name does not"):
        read_exec(command)
    call = read_exec(pushes["new"][0])
    assert call.service == git.RECEIVE and not call.repo.startswith("/")
    assert call.repo == read_exec(pushes["forward"][0]).repo


@pytest.mark.parametrize(("command", "expected"), [
    ("git-receive-pack 'acme/widget.git'", SshCall(git.RECEIVE, "acme/widget")),
    ("git-upload-pack '/acme/widget.git'", SshCall(git.UPLOAD, "acme/widget")),
    ("git-upload-archive 'acme/widget'", SshCall(git.ARCHIVE, "acme/widget")),
    ("git receive-pack '/acme/widget.GIT/'", SshCall(git.RECEIVE, "acme/widget")),
    ("git-upload-pack 'bob/x-y_1.2~.git'", SshCall(git.UPLOAD, "bob/x-y_1.2~")),
])
def test_exec_commands_are_read_as_git_quotes_them(command, expected):
    assert read_exec(command) == expected


@pytest.mark.parametrize(("command", "message"), [
    ("sh -c 'git-receive-pack x'", "not a git command"),
    ("git-shell -c \"git-receive-pack 'x'\"", "not a git command"),
    ("scp -t /tmp", "not a git command"),
    ("git-receive-pack 'a' 'b'", "more than one argument"),
    ("git-receive-pack 'a'b", "more than one argument"),
    ("git-receive-pack --stateless-rpc 'a'", "not single-quoted"),
    ("git-receive-pack a/b", "not single-quoted"),
    ("git-receive-pack  'a'", "not single-quoted"),
    ("git-receive-pack", "names no repository"),
    ("git upload-pack", "names no repository"),
    ("git-receive-pack 'a/b", "unbalanced"),
    ("git-receive-pack 'a'\\''", "unbalanced"),
    ("git-receive-pack 'a\0b'", "control character"),
    ("git-receive-pack 'a'\n", "control character"),
    ("git-receive-pack 'a/../b'", "'..' segment"),
    ("git-receive-pack 'a/./b'", "'..' segment"),
    ("git-receive-pack 'a/...git'", "'..' segment"),
    ("git-receive-pack 'a//b'", "empty"),
    ("git-receive-pack '//a'", "empty"),
    ("git-receive-pack '.git'", "empty"),
    ("git-receive-pack '/'", "empty"),
    # a glob (acme/*) matches any segment: what the gateway sends on must be a name, never
    # a quote that ends its own and runs a command on the host's shell
    ("git-upload-pack 'acme/x'\\''; id; echo '\\''y'", "a character a repository name"),
    ("git-receive-pack 'a/it'\\''s'\\!'.git'", "a character a repository name"),
    ("git-upload-pack 'acme/x y.git'", "a character a repository name"),
    # another user's home on a git-shell server, whatever glob matched it; an option
    ("git-upload-pack '~alice/widget.git'", "starts with '~'"),
    ("git-upload-pack '~/widget.git'", "starts with '~'"),
    ("git-upload-pack '--help'", "starts with '-'"),
    ("git-upload-pack 'acme/-x'", "starts with '-'"),
    ("git-upload-pack 'acme/$(id)'", "a character a repository name"),
    ("git-upload-pack 'acme/`id`'", "a character a repository name"),
    ("git-receive-pack '" + "a" * 1025 + "'", "longer than 1024"),
    ("git-receive-pack '" + "a" * 4096 + "'", "longer than 4096"),
])
def test_anything_else_on_an_exec_channel_is_refused_naming_why(command, message):
    with pytest.raises(git.GitProtocolError, match=message):
        read_exec(command)


# -- streams git would not send ------------------------------------------------------------


def command_section(caps: bytes = b"report-status") -> bytes:
    return git.pkt(b"0" * 40 + b" " + b"1" * 40 + b" " + WORK.encode() + b"\0" + caps
                   + b"\n") + git.FLUSH


def obj(kind: int, data: bytes, declared: int | None = None) -> bytes:
    """One whole object as a pack holds it: its type and size header, then zlib data."""
    size = len(data) if declared is None else declared
    first, size, header = (kind << 4) | (size & 15), size >> 4, bytearray()
    while size:
        header.append(first | 0x80)
        first, size = size & 0x7F, size >> 7
    header.append(first)
    return bytes(header) + zlib.compress(data)


def packed(*objects: bytes) -> bytes:
    pack = b"PACK\0\0\0\2" + len(objects).to_bytes(4, "big") + b"".join(objects)
    return pack + hashlib.sha1(pack).digest()


def refusal(*pieces: bytes) -> str:
    stream = PushStream()
    with pytest.raises(git.GitProtocolError) as refused:
        for piece in pieces:
            stream.feed(piece)
        stream.feed_eof()
    return str(refused.value)


def test_bytes_past_the_end_of_a_push_are_refused(pushes):
    sent = pushes["new"][1]
    assert "1 bytes after the pack's trailer" in refusal(sent + b"x")
    assert "4 bytes after the pack's trailer" in refusal(sent, b"0000")
    assert "after the commands" in refusal(pushes["delete"][1] + b"0000")
    assert "after the commands" in refusal(git.FLUSH, b"P")


def test_a_trailer_that_is_not_the_packs_hash_is_refused(pushes):
    for name in ("new", "sha256-new"):
        if name in pushes:
            sent = pushes[name][1]
            digest = "sha256" if name.startswith("sha256") else "sha1"
            assert f"not the {digest} of the pack" in refusal(sent[:-1] + bytes([sent[-1] ^ 1]))


def test_a_push_cut_short_says_where_it_stopped(pushes):
    sent = pushes["new"][1]
    pack = sent.index(b"PACK")
    assert "inside the pack's trailer" in refusal(sent[:-1])
    assert "inside object 1 of " in refusal(sent[: pack + 14])
    assert "before the pack's header" in refusal(sent[: pack + 3])
    assert "inside its commands" in refusal(sent[:10])
    assert "inside its commands" in refusal(b"")
    options = pushes["options"][1]
    assert "inside its push options" in refusal(options[: options.index(b"ci.skip")])


@pytest.mark.parametrize(("stream", "message"), [
    (b"zzzz", "not a pkt-line length"),
    (b"0x1f" + b"x" * 27, "not a pkt-line length"),
    (b"+0af", "not a pkt-line length"),
    (b"0003", "length of 3"),
    (b"0009abcde0000", "is not 'OLD NEW REF'"),  # read_push's own rules
    (command_section() + b"PACK\0\0\0\4\0\0\0\0", "does not start with a pack header"),
    (command_section() + b"PACK\0\0\0\2" + (packs.MAX_OBJECTS + 1).to_bytes(4, "big"),
     "at most 1000000"),
    (command_section() + packed(obj(5, b"x")), "unknown type 5"),
    (command_section() + packed(b"\x61" + b"\x80" * 10 + b"\0"), "delta offset longer"),
    (command_section() + packed(b"\x91" + b"\x80" * 20), "header longer than git writes"),
    (command_section() + packed(obj(packs.BLOB, b"x" * 100, declared=10)), "past the size"),
    (command_section() + packed(obj(packs.BLOB, b"x" * 10, declared=100)), "less than the size"),
    (command_section() + packed(b"\x31xx"), "does not inflate"),
])
def test_streams_git_does_not_send_are_refused(stream, message):
    assert message in refusal(stream)


def test_a_delta_against_an_object_of_the_pack_or_the_remote_is_walked_past():
    base = obj(packs.BLOB, b"base " * 20)
    ofs = b"\x60" + b"\x8f\x7f" + zlib.compress(b"")  # size 0, offset 2 bytes long
    ref = b"\x70" + b"\xaa" * 20 + zlib.compress(b"")
    sent = command_section() + packed(base, ofs, ref)
    assert PushStream().feed(sent)


def test_a_push_larger_than_git_max_push_is_refused(monkeypatch):
    monkeypatch.setattr(git, "MAX_PUSH", 100)
    stream = PushStream()
    stream.feed(b"ffff" + b"x" * 96)
    with pytest.raises(git.GitProtocolError, match="larger than 0 MiB"):
        stream.feed(b"0")


def test_a_body_is_only_given_once_the_push_is_whole():
    stream = PushStream()
    stream.feed(command_section())
    with pytest.raises(RuntimeError):
        stream.body  # noqa: B018


def zeros(mib: int) -> bytes:
    """A zlib stream of `mib` MiB of zeros, made without holding them: deflate blocks after
    a full flush are alike, then a final empty block and Adler-32 (1 + n * 65536 for n
    zeros)."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = deflate.compress(bytes(1 << 20)) + deflate.flush(zlib.Z_FULL_FLUSH)
    adler = ((mib << 20) % 65521) << 16 | 1
    return b"\x78\xda" + block * mib + b"\x03\x00" + adler.to_bytes(4, "big")


def test_a_zlib_bomb_costs_cpu_not_memory(monkeypatch):
    assert zlib.decompress(zeros(2)) == bytes(2 << 20)
    size = 256 << 20
    header = obj(packs.BLOB, b"", declared=size)[:-len(zlib.compress(b""))]
    sent = command_section() + packed(header + zeros(size >> 20))
    chunks = [sent[i : i + 32768] for i in range(0, len(sent), 32768)]
    tracemalloc.start()
    try:
        stream = PushStream()
        assert [stream.feed(chunk) for chunk in chunks][-1]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < len(sent) * 2 + (2 << 20), peak  # what was sent, not what it inflates to
    monkeypatch.setattr(packs, "MAX_INFLATED", 64 << 20)
    assert "inflates to more than 64 MiB" in refusal(*chunks)


def test_reading_is_linear_in_the_push_however_it_arrives(monkeypatch):
    """Counted, not timed: the bytes handed to zlib, for 32,000 tiny objects in one chunk
    and in 32 KiB chunks. Each object's inflater starts with a small piece (64 bytes) and
    doubles it, so a byte is handed over a bounded number of times; handing each inflater
    the rest of its chunk, or reading the stream anew at each chunk, costs thousands of
    times the push."""
    handed = [0]
    real = zlib.decompressobj

    class Counting:
        def __init__(self, *args):
            self.inner = real(*args)

        def decompress(self, data, max_length=0):
            handed[0] += len(data)
            return self.inner.decompress(data, max_length)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(sshwire.zlib, "decompressobj", Counting)
    count = 32_000
    sent = command_section() + packed(*(obj(packs.BLOB, b"%d" % i) for i in range(count)))
    assert PushStream().feed(sent)
    stream = PushStream()
    assert [stream.feed(sent[i : i + 32768]) for i in range(0, len(sent), 32768)][-1]
    assert handed[0] <= 2 * (64 * count + 2 * len(sent)), (handed[0], len(sent))


def test_the_module_keeps_to_the_standard_library():
    imports = [line for line in Path(sshwire.__file__).read_text().splitlines()
               if line.startswith(("import ", "from "))]
    assert all(line.split()[1].split(".")[0] in {"__future__", "hashlib", "re", "zlib",
                                                 "dataclasses", "appliance"}
               for line in imports), imports
