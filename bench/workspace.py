"""How long `corral diff` / `corral apply` take on the appliance for a big project, and how
much memory: the `diff` op (changes + review) and the `changes` op (changes + carry + JSON).

  python -m bench.workspace [--files 20000] [--megabytes 200] [--runs 3]
                            [--module OTHER.py]    the same, for another workspace module
                                                   (the one before format 2, for instance)

The project is FILES files in directories of 100, MEGABYTES in all; the agent then modifies
1% of them, adds 0.5% and removes 0.25%. Each measurement runs in a forked child, so its
peak RSS (ru_maxrss) is its own; page cache is warm after the first run (the median is
reported). Ratios between two modules measured in the same run are what to compare.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def build(top: Path, files: int, megabytes: int, seed: int = 1) -> tuple[Path, Path]:
    rng = random.Random(seed)  # noqa: S311 - a reproducible project, not a secret
    project = top / "project"
    size = megabytes * 1_000_000 // files
    line = b"const value = 'some text of a typical source line';\n"
    body = (line * (size // len(line) + 1))[:size]
    for i in range(files):
        directory = project / f"dir{i // 100}"
        if i % 100 == 0:
            directory.mkdir(parents=True)
        (directory / f"file{i}.js").write_bytes(body[:-8] + b"%08d" % i)
    work, base = top / "work", top / "base"
    shutil.copytree(project, base, symlinks=True)
    shutil.copytree(project, work, symlinks=True)
    paths = sorted(work.rglob("*.js"))
    for path in rng.sample(paths, files // 100):
        data = bytearray(path.read_bytes())
        data[len(data) // 2:len(data) // 2 + 5] = b"AGENT"
        path.write_bytes(bytes(data))
    for i in range(files // 200):
        (work / f"dir{i}" / f"new{i}.js").write_bytes(body[: size // 2])
    for path in rng.sample(paths, files // 400):
        path.unlink(missing_ok=True)
    return base, work


def load(path: str | None):
    if path is None:
        import appliance.workspace as module
        return module
    spec = importlib.util.spec_from_file_location("other_workspace", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def operations(module):
    if hasattr(module, "carry"):  # format 2
        def diff(base, work):
            found = module.changes(base, work)
            return len(module.review(found)[0]), len(found)

        def changes(base, work):
            carried = module.carry(module.changes(base, work))
            return len(json.dumps([module.to_json(c) for c in carried])), len(carried)
    else:
        def diff(base, work):
            found = module.changes(base, work)
            return len(module.render(found)), len(found)

        def changes(base, work):
            found = module.changes(base, work)
            return len(json.dumps([module.to_json(c) for c in found])), len(found)
    return {"diff": diff, "changes": changes}


def measure(run, base: Path, work: Path) -> dict:
    """One run in a forked child: seconds, peak RSS, and what it produced."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        started = time.perf_counter()
        size, count = run(base, work)
        seconds = time.perf_counter() - started
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        os.write(write, json.dumps({"seconds": seconds, "peak_mb": peak / 1024, "output": size,
                                    "changes": count}).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as stream:
        result = json.loads(stream.read())
    os.waitpid(pid, 0)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=20_000)
    parser.add_argument("--megabytes", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--module", action="append", default=None,
                        help="a workspace module file to measure too (repeatable)")
    args = parser.parse_args()
    top = Path(tempfile.mkdtemp(prefix="corral-bench-ws-"))
    try:
        base, work = build(top, args.files, args.megabytes)
        modules = {"this": load(None), **{Path(m).name: load(m) for m in args.module or []}}
        print(f"{args.files} files, {args.megabytes} MB; median of {args.runs} runs "
              "(page cache warm after the first)")
        for op in ("diff", "changes"):
            for name, module in modules.items():
                results = [measure(operations(module)[op], base, work) for _ in range(args.runs)]
                print(f"  {op:<8} {name:<20} "
                      f"{statistics.median(r['seconds'] for r in results):7.2f} s  "
                      f"peak {max(r['peak_mb'] for r in results):7.1f} MB  "
                      f"{results[0]['changes']} changes, {results[0]['output']} bytes out")
    finally:
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()
