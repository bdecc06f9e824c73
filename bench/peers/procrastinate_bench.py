"""Procrastinate peer benchmark: N no-op jobs through Procrastinate on PostgreSQL, worker in process.

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/somedb bench/.peers/procrastinate/bin/python \
        bench/peers/procrastinate_bench.py --runs 5000

Worker: `App.run_worker_async` in the same process and event loop as the producers (`procrastinate worker` runs
the same), concurrency = --concurrency (16; Procrastinate's default is 1), LISTEN/NOTIFY on (default), finished
jobs kept (default). One psycopg pool of 4-10 connections for the app. Batched enqueue: `batch_defer_async`.
See bench/peers/common.py for the phases.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from importlib.metadata import version
from typing import Any

from common import Peer, database_url, main
from procrastinate import App, PsycopgConnector

QUEUE = "bench"


class ProcrastinatePeer(Peer):
    name = "procrastinate"
    batch_chunk = 1000

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.app = App(connector=PsycopgConnector(conninfo=database_url(), min_size=4, max_size=10))
        tracker = self.tracker

        @self.app.task(name="noop", queue=QUEUE)
        async def noop(t: float | None = None) -> None:
            tracker.hit(t)

        self.task = noop
        self.worker: asyncio.Task[None] | None = None
        self.opened = False

    def describe(self) -> dict[str, Any]:
        return {"version": version("procrastinate"), "how": f"in process: run_worker_async concurrency "
                f"{self.args.concurrency}, LISTEN/NOTIFY; pool of 4-10 connections"}

    async def setup(self) -> None:
        await self.app.open_async()
        self.opened = True
        await self.app.schema_manager.apply_schema_async()

    async def teardown(self) -> None:
        await self.stop_worker()
        if self.opened:
            await self.app.close_async()

    async def start_worker(self) -> None:
        self.worker = asyncio.create_task(self.app.run_worker_async(
            queues=[QUEUE], concurrency=self.args.concurrency, wait=True, install_signal_handlers=False))

    async def stop_worker(self) -> None:
        if self.worker is None:
            return
        task, self.worker = self.worker, None
        task.cancel()  # Procrastinate stops gracefully on cancellation
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def enqueue_batch(self, stamps: list[float | None]) -> None:
        jobs: list[dict[str, Any]] = [{"t": s} for s in stamps]
        await self.task.batch_defer_async(*jobs)

    async def enqueue_one(self, stamp: float | None) -> None:
        await self.task.defer_async(t=stamp)


if __name__ == "__main__":
    main(ProcrastinatePeer)
