"""DBOS Transact peer benchmark: N no-op workflows through a DBOS queue on PostgreSQL, worker in process.

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/somedb bench/.peers/dbos/bin/python \
        bench/peers/dbos_bench.py --runs 5000

DBOS runs its queue poller and the workflows inside the application process (there is no separate worker
command): `DBOS.launch()`, a queue registered with `DBOS.register_queue`, async workflows `Queue.enqueue_async`-ed.
Queue settings: no worker_concurrency (default: a poll claims every queued workflow), polling interval from
DBOS_POLL_INTERVAL, DBOS's default 1 s when unset. The poller cannot be paused, so in the batch phase it claims
jobs while the batch is still being enqueued. DBOS has no batched enqueue: `enqueue_async` calls in
`asyncio.gather`, 50 at a time. The workflow's own record (status, result) is DBOS's normal cost per job.
See bench/peers/common.py for the phases.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from importlib.metadata import version
from typing import Any

from common import Peer, Tracker, database_url, main
from dbos import DBOS

POLL_INTERVAL = float(os.environ.get("DBOS_POLL_INTERVAL", "1.0"))  # DBOS's default: 1 s
QUEUE = "bench"
TRACKER: Tracker | None = None


@DBOS.workflow(name="noop")
async def noop(t: float | None = None) -> None:
    assert TRACKER is not None
    TRACKER.hit(t)


class DbosPeer(Peer):
    name = "dbos"
    batch_chunk = 50

    def __init__(self, args: argparse.Namespace) -> None:
        global TRACKER
        super().__init__(args)
        TRACKER = self.tracker
        self.queue: Any = None
        self.launched = False

    def describe(self) -> dict[str, Any]:
        return {"version": version("dbos"), "how": f"in process: DBOS queue poller, polling {POLL_INTERVAL:g} s"
                + (" (default)" if POLL_INTERVAL == 1.0 else "") + ", no worker_concurrency cap (default)"}

    async def setup(self) -> None:
        DBOS(config={"name": "peersbench", "system_database_url": database_url(), "log_level": "WARNING"})
        await asyncio.to_thread(DBOS.launch)
        self.launched = True
        self.queue = await DBOS.register_queue_async(QUEUE, polling_interval_sec=POLL_INTERVAL)

    async def teardown(self) -> None:
        if self.launched:
            await asyncio.sleep(1.0)  # the last workflows record their outcome after their body ran
            await asyncio.to_thread(DBOS.destroy)

    async def start_worker(self) -> None:
        pass  # the poller runs from launch to destroy

    async def stop_worker(self) -> None:
        pass

    async def enqueue_batch(self, stamps: list[float | None]) -> None:
        await asyncio.gather(*(self.queue.enqueue_async(noop, s) for s in stamps))

    async def enqueue_one(self, stamp: float | None) -> None:
        await self.queue.enqueue_async(noop, stamp)


if __name__ == "__main__":
    main(DbosPeer)
