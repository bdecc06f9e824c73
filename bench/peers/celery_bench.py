"""Celery peer benchmark: N no-op tasks through Celery with the Redis broker, run by a real `celery worker`.

    REDIS_URL=redis://127.0.0.1:6379/15 bench/.peers/celery/bin/python bench/peers/celery_bench.py --runs 5000

Worker: `celery -A celery_bench worker -P prefork -c 16` (as people run it; one master and 16 pool processes),
started by this script in its own process tree and stopped at the end. No result backend: each task INCRs a
counter in Redis (and records its start latency there in the latency phase), which is how this script learns the
N-th task ran; it costs one or two Redis commands per task on top of Celery's own. Producers: `apply_async`
(batched: one loop on one producer connection, as `group().apply_async` does; concurrent: threads, since the
client is synchronous). The worker starts on a dummy queue and is told to consume the bench queue with
`control.add_consumer` once the batch is enqueued. See bench/peers/common.py for the phases.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
from celery import Celery
from common import Peer, log, main, redis_url
from kombu import Exchange, Queue

HERE = Path(__file__).resolve().parent
QUEUE = "bench"
IDLE_QUEUE = "bench_idle"

app = Celery("celery_bench", broker=redis_url())
app.conf.update(task_ignore_result=True, broker_connection_retry_on_startup=True, broker_pool_limit=64,
                task_queues=[Queue(QUEUE, Exchange(QUEUE), routing_key=QUEUE),
                             Queue(IDLE_QUEUE, Exchange(IDLE_QUEUE), routing_key=IDLE_QUEUE)],
                worker_hijack_root_logger=False)

_client: redis.Redis | None = None  # one per worker process, made after the fork


@app.task(name="bench.noop")
def noop(t: float | None = None, n: int = 0, k: str = "") -> None:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(redis_url())
    now = time.time()
    if t is not None:
        _client.rpush(f"bench:lat:{k}", (now - t) * 1000)
    if _client.incr(f"bench:count:{k}") == n:
        _client.rpush(f"bench:done:{k}", now)


class CeleryPeer(Peer):
    name = "celery"
    batch_chunk = 1000

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.worker: subprocess.Popen[bytes] | None = None
        self.node = f"bench{secrets.token_hex(3)}@localhost"
        self.aredis = aioredis.Redis.from_url(redis_url())
        self.phase_key = ""
        self.target = 0
        self.consuming = False
        self.pool = ThreadPoolExecutor(max_workers=max(args.producers, 1))

    def describe(self) -> dict[str, Any]:
        return {"version": version("celery"), "how": f"celery worker processes: prefork -c {self.args.concurrency}, "
                f"Redis broker, no result backend; {self.args.producers} producer threads"}

    async def setup(self) -> None:
        with app.connection_for_write() as conn:
            for q in app.conf.task_queues:
                q(conn).declare()
        cmd = [sys.executable, "-m", "celery", "-A", "celery_bench", "worker", "-P", "prefork",
               "-c", str(self.args.concurrency), "-Q", IDLE_QUEUE, "-n", self.node, "-l", "WARNING"]
        self.worker = await asyncio.to_thread(subprocess.Popen, cmd, cwd=HERE, stdin=subprocess.DEVNULL,
                                              stdout=sys.stderr)
        deadline = time.monotonic() + 90
        while not await asyncio.to_thread(app.control.ping, destination=[self.node], timeout=1.0):
            if self.worker.poll() is not None:
                raise RuntimeError(f"celery worker exited with {self.worker.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError("celery worker did not answer a ping within 90 s")
        log(f"celery worker {self.node} ready")

    async def teardown(self) -> None:
        if self.worker is not None and self.worker.poll() is None:
            self.worker.send_signal(signal.SIGTERM)  # warm shutdown
            try:
                await asyncio.to_thread(self.worker.wait, 30)
            except subprocess.TimeoutExpired:
                self.worker.kill()
                await asyncio.to_thread(self.worker.wait)
        self.pool.shutdown()
        await self.aredis.aclose()

    async def _control(self, command: str) -> None:
        fn = app.control.add_consumer if command == "add" else app.control.cancel_consumer
        replies = await asyncio.to_thread(fn, QUEUE, destination=[self.node], reply=True, timeout=10)
        if not replies:
            raise RuntimeError(f"celery worker did not answer {command}_consumer")

    async def start_worker(self) -> None:
        if not self.consuming:
            await self._control("add")
            self.consuming = True

    async def stop_worker(self) -> None:
        if self.consuming:
            await self._control("cancel")
            self.consuming = False

    async def reset_tracker(self, target: int) -> None:
        self.phase_key, self.target = secrets.token_hex(4), target

    async def wait_done(self, limit_s: float) -> float:
        deadline = time.monotonic() + limit_s
        # short BLPOPs: redis-py's default socket timeout (5 s) would cut a longer one
        while (got := await self.aredis.blpop([f"bench:done:{self.phase_key}"], timeout=1)) is None:
            if time.monotonic() > deadline:
                count = await self.aredis.get(f"bench:count:{self.phase_key}")
                raise TimeoutError(f"{int(count or 0)} of {self.target} tasks ran within {limit_s:.0f} s")
        # wall clock of the N-th task's start, as a perf_counter() time of this process
        return time.perf_counter() - (time.time() - float(got[1]))

    def latencies(self) -> list[float]:
        client = redis.Redis.from_url(redis_url())
        try:
            return [float(x) for x in client.lrange(f"bench:lat:{self.phase_key}", 0, -1)]
        finally:
            client.close()

    def _send(self, stamp: float | None, producer: Any = None) -> None:
        noop.apply_async(kwargs={"t": stamp, "n": self.target, "k": self.phase_key}, queue=QUEUE,
                         producer=producer)

    async def enqueue_batch(self, stamps: list[float | None]) -> None:
        def send_all() -> None:
            with app.producer_or_acquire() as producer:
                for s in stamps:
                    self._send(s, producer)

        await asyncio.to_thread(send_all)

    async def enqueue_one(self, stamp: float | None) -> None:
        await asyncio.to_thread(self._send, stamp)

    async def enqueue_concurrently(self, n: int, producers: int, rate: float | None, stamp: bool) -> None:
        counter = iter(range(n))
        lock = threading.Lock()
        start = time.time()

        def producer() -> None:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                if rate:
                    delay = start + i / rate - time.time()
                    if delay > 0:
                        time.sleep(delay)
                self._send(time.time() if stamp else None)

        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self.pool, producer) for _ in range(producers)))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(HERE))
    main(CeleryPeer)
