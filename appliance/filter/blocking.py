"""The filter's blocking threads: where disk and nftables work runs, off the event loop.

Changes (one at a time, changes.py), audit pages, firewall checks and secrets files run
here. Not the loop's default executor, which the DNS filter's firewall learning uses:
neither waits for the other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

THREADS = 4


class Blocking:
    def __init__(self, threads: int = THREADS):
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="corral-blocking")

    async def run(self, work: Callable, *args):
        """`work(*args)` on a blocking thread; the loop goes on serving meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, work, *args)

    def shutdown(self, wait: bool = True) -> None:
        self.executor.shutdown(wait=wait, cancel_futures=not wait)
