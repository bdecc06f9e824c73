"""PgQueuer peer benchmark: N no-op jobs through PgQueuer on PostgreSQL, worker in process.

    bench/.peers/pgqueuer/bin/python bench/peers/pgqueuer_bench.py --runs 5000   # DATABASE_URL: a fresh database

Worker: a `QueueManager` on its own asyncpg connection in the same process and event loop as the producers
(what `pgq run` does), PgQueuer's defaults: batch_size 10, no concurrency cap, LISTEN/NOTIFY wake-ups.
Producers share an asyncpg pool of 8 connections. Batched enqueue: `Queries.enqueue` with lists.
See bench/peers/common.py for the phases.
"""

from __future__ import annotations

import argparse
import asyncio
from importlib.metadata import version
from typing import Any

import asyncpg
from common import Peer, database_url, main
from pgqueuer import AsyncpgDriver, AsyncpgPoolDriver, Job, Queries, QueueManager


class PgQueuerPeer(Peer):
    name = "pgqueuer"
    batch_chunk = 1000

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.pool: asyncpg.Pool | None = None
        self.queries: Queries | None = None
        self.worker: tuple[QueueManager, asyncpg.Connection, Any] | None = None

    def describe(self) -> dict[str, Any]:
        return {"version": version("pgqueuer"), "how": "in process: QueueManager, batch_size 10 (default), "
                "no concurrency cap (default); 8-connection asyncpg pool for producers"}

    async def setup(self) -> None:
        conn = await asyncpg.connect(database_url())
        try:
            await Queries(AsyncpgDriver(conn)).install()
        finally:
            await conn.close()
        self.pool = await asyncpg.create_pool(database_url(), min_size=8, max_size=8)
        self.queries = Queries(AsyncpgPoolDriver(self.pool))

    async def teardown(self) -> None:
        await self.stop_worker()
        if self.pool is not None:
            await self.pool.close()

    async def start_worker(self) -> None:
        conn = await asyncpg.connect(database_url())
        qm = QueueManager(Queries(AsyncpgDriver(conn)))
        tracker = self.tracker

        @qm.entrypoint("noop")
        async def noop(job: Job) -> None:
            tracker.hit(float(job.payload) if job.payload else None)

        self.worker = (qm, conn, asyncio.create_task(qm.run(batch_size=10)))

    async def stop_worker(self) -> None:
        if self.worker is None:
            return
        qm, conn, task = self.worker
        self.worker = None
        qm.shutdown.set()
        await task
        await conn.close()

    async def enqueue_batch(self, stamps: list[float | None]) -> None:
        assert self.queries is not None
        await self.queries.enqueue(["noop"] * len(stamps), [_payload(s) for s in stamps], [0] * len(stamps))

    async def enqueue_one(self, stamp: float | None) -> None:
        assert self.queries is not None
        await self.queries.enqueue("noop", _payload(stamp))


def _payload(stamp: float | None) -> bytes | None:
    return repr(stamp).encode() if stamp is not None else None


if __name__ == "__main__":
    main(PgQueuerPeer)
