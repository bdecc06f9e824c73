"""arq peer benchmark: N no-op jobs through arq on Redis, worker in process.

    REDIS_URL=redis://127.0.0.1:6379/15 bench/.peers/arq/bin/python bench/peers/arq_bench.py --runs 5000

Worker: an `arq.worker.Worker` in the same process and event loop as the producers (`arq` CLI runs the same
class), max_jobs = --concurrency (16; arq's default is 10), poll_delay from ARQ_POLL_DELAY, arq's default
0.5 s when unset (arq polls the queue's sorted set, at most 100 jobs per poll: no push wake-up, so the default
caps it near 200 jobs/s), default keep_result (results stay in Redis for an hour).
Batched enqueue: `enqueue_job` calls in `asyncio.gather`, 100 at a time. See bench/peers/common.py for the phases.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from importlib.metadata import version
from typing import Any

from arq import ArqRedis, Worker, create_pool, func
from arq.connections import RedisSettings
from common import Peer, main, redis_url

POLL_DELAY = float(os.environ.get("ARQ_POLL_DELAY", "0.5"))  # arq's default: 0.5 s


class ArqPeer(Peer):
    name = "arq"
    batch_chunk = 100

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.settings = RedisSettings.from_dsn(redis_url())
        self.pool: ArqRedis | None = None
        self.worker: tuple[Worker, asyncio.Task[None]] | None = None

    def describe(self) -> dict[str, Any]:
        return {"version": version("arq"), "how": f"in process: Worker max_jobs {self.args.concurrency}, "
                f"poll_delay {POLL_DELAY:g} s" + (" (default)" if POLL_DELAY == 0.5 else "")}

    async def setup(self) -> None:
        self.pool = await create_pool(self.settings)

    async def teardown(self) -> None:
        await self.stop_worker()
        if self.pool is not None:
            await self.pool.aclose()

    async def start_worker(self) -> None:
        tracker = self.tracker

        async def noop(ctx: dict[str, Any], t: float | None = None) -> None:
            tracker.hit(t)

        worker = Worker(functions=[func(noop, name="noop")], redis_settings=self.settings,
                        max_jobs=self.args.concurrency, poll_delay=POLL_DELAY, handle_signals=False)
        self.worker = (worker, asyncio.create_task(worker.main()))

    async def stop_worker(self) -> None:
        if self.worker is None:
            return
        worker, task = self.worker
        self.worker = None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # let jobs in flight finish (close() would cancel them) before closing the worker's pool
        await asyncio.gather(*worker.tasks.values(), return_exceptions=True)
        await worker.close()

    async def enqueue_batch(self, stamps: list[float | None]) -> None:
        assert self.pool is not None
        await asyncio.gather(*(self.pool.enqueue_job("noop", s) for s in stamps))

    async def enqueue_one(self, stamp: float | None) -> None:
        assert self.pool is not None
        await self.pool.enqueue_job("noop", stamp)


if __name__ == "__main__":
    main(ArqPeer)
