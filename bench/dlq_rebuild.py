"""The DLQ's rebuild after Redis lost its data: how long each reconciler pass takes and how many
passes (of ``reconcile_budget`` dead runs each) bring every entry back.

    python bench/dlq_rebuild.py [--sizes 1000,10000,100000] [--budget 2000]

For each size it triggers that many runs into one environment (a fresh database and key prefix),
marks them dead-lettered in PostgreSQL as the DLQ's move leaves them (status SYSTEM_FAILURE,
finished) with one UPDATE (dead-lettering 100,000 runs one timeout at a time takes too long for a
benchmark), drops the prefix's keys (what a FLUSHALL does to them), then runs reconciler passes
until the rebuild is through. Prints the passes, the median and slowest pass (wall and CPU ms) and
the rebuild's total time without the interval between passes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import DEFAULT_REDIS, delete_prefix, fresh_database, median  # noqa: E402
from run_engine.engine import RunEngine, TaskSpec, TriggerRequest  # noqa: E402
from run_engine.settings import EngineSettings  # noqa: E402
from run_engine.tenancy import ensure_environment  # noqa: E402


async def measure(size: int, budget: int, database_url: str, redis_url: str) -> tuple[int, float, float, float, float]:
    prefix = f"bench-dlq-{secrets.token_hex(4)}"
    engine = await RunEngine.create(EngineSettings(database_url=database_url, redis_url=redis_url, key_prefix=prefix,
                                                   max_queue_length=None, reconcile_budget=budget), run_jobs=False)
    try:
        env = await ensure_environment(engine.resources.repo, secret="bench-secret", org="bench", project="p",
                                       env="dev")
        await engine.register_deployment(env_id=env.env_id, worker_group_id=env.worker_group_id, version="1",
                                         content_hash="h", tasks=[TaskSpec("noop")], queues=[])
        for start in range(0, size, 1000):
            await engine.trigger_many([TriggerRequest(env_id=env.env_id, task_id="noop", payload=i)
                                       for i in range(start, min(size, start + 1000))])
        async with engine.resources.repo.pool.connection() as conn:
            await conn.execute("UPDATE task_run SET status = 'SYSTEM_FAILURE', finished_at = now()")
        await delete_prefix(redis_url, prefix)
        queue, reconciler = engine.resources.queue, engine.systems.reconciler
        wall, cpu = [], []
        while True:
            c0, t0 = time.process_time(), time.perf_counter()
            await reconciler.reconcile(grace_s=-1)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            if await queue.dlq_rebuild_after() is None:
                break
        listed = (await queue.env_counts([env.env_id]))[0]
        assert listed[2] == size, (listed, size)
        return len(wall), median(wall) * 1000, max(wall) * 1000, median(cpu) * 1000, sum(wall)
    finally:
        await engine.close()
        await delete_prefix(redis_url, prefix)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--budget", type=int, default=2000)
    args = parser.parse_args()
    redis_url = os.environ.get("REDIS_URL", DEFAULT_REDIS)
    print(f"{'dead runs':>9} {'passes':>7} {'pass ms':>8} {'max ms':>8} {'pass cpu ms':>12} {'total s':>8}")
    for size in (int(s) for s in args.sizes.split(",")):
        with fresh_database() as database_url:
            passes, wall, worst, cpu, total = await measure(size, args.budget, database_url, redis_url)
        print(f"{size:>9} {passes:>7} {wall:>8.1f} {worst:>8.1f} {cpu:>12.1f} {total:>8.2f}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
