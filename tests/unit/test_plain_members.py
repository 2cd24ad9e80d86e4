"""The unpack check for Pythons without tarfile's data filter (Debian 12's 3.11.2, a local
backend's on Debian 12): only plain files and directories get through, with plain
permissions."""

import io
import tarfile

import pytest

from appliance.sandbox.service import RequestError, _plain_members


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


@pytest.mark.parametrize(("info", "message"), [
    (_info("../escape"), "absolute paths and '..'"),
    (_info("a/../../escape"), "absolute paths and '..'"),
    (_info("/etc/passwd"), "absolute paths and '..'"),
    (_info("link", tarfile.SYMTYPE, link="."), "not a regular file"),
    (_info("hard", tarfile.LNKTYPE, link="a"), "not a regular file"),
    (_info("dev", tarfile.CHRTYPE), "not a regular file"),
    (_info("fifo", tarfile.FIFOTYPE), "not a regular file"),
])
def test_anything_but_plain_files_and_directories_is_refused(info, message):
    with _tar(_info("ok.txt"), info) as tar, pytest.raises(RequestError, match=message):
        _plain_members(tar.getmembers())


def test_plain_members_unpack_with_plain_permissions(tmp_path):
    members = [_info("bin", tarfile.DIRTYPE, mode=0o7777),
               _info("bin/tool", mode=0o4755), _info("notes.txt", mode=0o666)]
    with _tar(*members) as tar:
        # where tarfile has filters (3.12+, and 3.11 from 3.11.4), none of them: what is
        # tested is what _plain_members alone lets through, as on a Python without them
        no_filter = {"filter": "fully_trusted"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp_path, members=_plain_members(tar.getmembers()), **no_filter)
    modes = {p.name: p.stat().st_mode & 0o7777 for p in tmp_path.rglob("*")}
    assert modes == {"bin": 0o755, "tool": 0o755, "notes.txt": 0o644}
