"""Cost of one reconciler pass against the backlog: with an incremental scan a pass reads at most
``reconcile_budget`` QUEUED runs, so it costs about the same with 1,000 or 100,000 runs waiting.

    python bench/reconcile_backlog.py [--sizes 1000,10000,100000] [--passes 5]

For each size it triggers that many runs into one environment (a fresh database and key prefix)
and times incremental passes (the leader's duty) and one full pass (what a pass after Redis lost
its data does), CPU and wall time. Last line: ``reconcile pass cost ratio <max>/<min>: <n>``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import DEFAULT_REDIS, delete_prefix, fresh_database, median, noop_engine  # noqa: E402
from run_engine.engine import TriggerRequest  # noqa: E402


async def measure(size: int, passes: int, database_url: str, redis_url: str) -> tuple[float, float, float]:
    engine, env = await noop_engine("rec", database_url, redis_url)
    prefix = engine.resources.settings.key_prefix
    try:
        for start in range(0, size, 1000):
            await engine.trigger_many([TriggerRequest(env_id=env.env_id, task_id="noop", payload=i)
                                       for i in range(start, min(size, start + 1000))])
        reconciler = engine.systems.reconciler
        await reconciler.reconcile(grace_s=-1)  # marks the epoch (a fresh key prefix has none)
        wall, cpu = [], []
        for _ in range(passes):
            c0, t0 = time.process_time(), time.perf_counter()
            report = await reconciler.reconcile(grace_s=-1)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            assert report.requeued_missing == 0, report
        t0 = time.perf_counter()
        await reconciler.reconcile(grace_s=-1, full=True)
        full = time.perf_counter() - t0
        return median(wall) * 1000, median(cpu) * 1000, full * 1000
    finally:
        await engine.close()
        await delete_prefix(redis_url, prefix)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    redis_url = os.environ.get("REDIS_URL", DEFAULT_REDIS)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"{'queued':>8} {'pass ms':>9} {'pass cpu ms':>12} {'full pass ms':>13}")
    results = {}
    for size in sizes:
        with fresh_database() as database_url:
            wall, cpu, full = await measure(size, args.passes, database_url, redis_url)
        results[size] = wall
        print(f"{size:>8} {wall:>9.1f} {cpu:>12.1f} {full:>13.1f}", flush=True)
    lo, hi = min(sizes), max(sizes)
    print(f"reconcile pass cost ratio {hi}/{lo}: {results[hi] / results[lo]:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
