"""The unpack check for Pythons without tarfile's data filter (Debian 12's 3.11.2, a local
backend's on Debian 12): each member judged at its turn against what is on disk, as that
filter does; files, directories and links that stay inside, with plain permissions."""

import io
import os
import tarfile

import pytest

from appliance.sandbox.service import RequestError, _extract_checked


def _tar(*infos: tarfile.TarInfo) -> tarfile.TarFile:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for info in infos:
            tar.addfile(info, io.BytesIO(b"x" * info.size) if info.isreg() else None)
    out.seek(0)
    return tarfile.open(fileobj=out)


def _info(name, kind=tarfile.REGTYPE, mode=0o644, size=1, link=""):
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname = kind, mode, link
    info.size = size if kind == tarfile.REGTYPE else 0
    return info


@pytest.mark.parametrize(("infos", "message"), [
    ([_info("../escape")], "absolute paths and '..'"),
    ([_info("a/../../escape")], "absolute paths and '..'"),
    ([_info("/etc/passwd")], "absolute paths and '..'"),
    ([_info("out", tarfile.SYMTYPE, link="/etc/passwd")], "absolute link targets"),
    ([_info("up", tarfile.SYMTYPE, link="../x")], "points outside"),
    ([_info("hard", tarfile.LNKTYPE, link="/etc/shadow")], "absolute link targets"),
    # each link inside when judged alone: `d` -> `.`, then `d/e` -> `..` is the parent
    # of the destination once `d` is on disk, and `e/escape` would be written there
    ([_info("d", tarfile.SYMTYPE, link="."), _info("d/e", tarfile.SYMTYPE, link=".."),
      _info("e/escape")], "outside the destination"),
    ([_info("dev", tarfile.CHRTYPE)], "not a regular file, directory or link"),
    ([_info("fifo", tarfile.FIFOTYPE)], "not a regular file, directory or link"),
])
def test_anything_that_leaves_the_project_or_is_special_is_refused(tmp_path, infos, message):
    target = tmp_path / "project"
    target.mkdir()
    with _tar(_info("ok.txt"), *infos) as tar, pytest.raises(RequestError, match=message):
        _extract_checked(tar, tar.getmembers(), target)
    assert {p.name for p in tmp_path.iterdir()} == {"project"}  # nothing written beside it


def test_files_directories_and_links_inside_unpack_with_plain_permissions(tmp_path):
    members = [_info("bin", tarfile.DIRTYPE, mode=0o7777),
               _info("bin/tool", mode=0o4755), _info("notes.txt", mode=0o666),
               _info("bin/run", tarfile.SYMTYPE, link="tool"),
               _info("loop", tarfile.SYMTYPE, link="loop"),
               _info("same", tarfile.LNKTYPE, link="notes.txt")]
    with _tar(*members) as tar:
        _extract_checked(tar, tar.getmembers(), tmp_path)
    modes = {p.name: p.lstat().st_mode & 0o7777 for p in tmp_path.rglob("*")
             if not p.is_symlink()}
    assert modes == {"bin": 0o755, "tool": 0o755, "notes.txt": 0o644, "same": 0o644}
    assert os.readlink(tmp_path / "bin/run") == "tool" and os.readlink(tmp_path / "loop") == "loop"
    assert (tmp_path / "same").stat().st_ino == (tmp_path / "notes.txt").stat().st_ino
