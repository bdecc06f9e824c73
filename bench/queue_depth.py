"""Dequeue cost against backlog size: the queue must cost O(log n), so a dequeue with 1,000,000
runs queued costs about what it costs with 1,000.

    python bench/queue_depth.py [--sizes 1000,100000,1000000] [--samples 500]

For each size it fills one environment (half the runs in one queue without concurrency keys,
half spread over 1,000 concurrency keys of a second queue, plus a second environment), then
times dequeue-1 + ack pairs. Last line: ``dequeue cost ratio 1M/1k: <number>``.
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

import redis.asyncio as aioredis  # noqa: E402

from bench._common import DEFAULT_REDIS, delete_prefix, median, pct  # noqa: E402
from run_engine.run_queue import EnqueueItem, RunQueue  # noqa: E402

NOW = 1_700_000_000_000


async def fill(q: RunQueue, size: int, tag: str) -> None:
    batch: list[EnqueueItem] = []
    pending: list[asyncio.Future[None]] = []
    for i in range(size):
        env = "env_big" if i % 10 else "env_other"
        if i % 2:
            batch.append(EnqueueItem(f"{tag}{i}", env, "plain", "wg", NOW + i))
        else:
            batch.append(
                EnqueueItem(f"{tag}{i}", env, "keyed", "wg", NOW + i, concurrency_key=f"k{i % 1000}")
            )
        if len(batch) == 1000:
            pending.append(asyncio.ensure_future(q.enqueue(batch, NOW)))
            batch = []
            if len(pending) >= 8:
                await asyncio.gather(*pending)
                pending.clear()
    if batch:
        pending.append(asyncio.ensure_future(q.enqueue(batch, NOW)))
    await asyncio.gather(*pending)


async def measure(q: RunQueue, samples: int) -> list[float]:
    costs = []
    for _ in range(samples):
        t = time.perf_counter()
        [m] = await q.dequeue("wg", 1, NOW + 10**9)
        await q.ack([(m.env_id, m.run_id)])
        costs.append((time.perf_counter() - t) * 1e6)
    return costs


async def main_async(sizes: list[int], samples: int, redis_url: str) -> dict[int, float]:
    client = aioredis.Redis.from_url(redis_url)
    results: dict[int, float] = {}
    print(f"{'queued':>10}{'fill s':>9}{'p50 us':>10}{'p99 us':>10}{'redis MB':>10}")
    prefix = f"reqd{secrets.token_hex(3)}"
    try:
        for size in sizes:
            q = RunQueue(client, prefix=f"{prefix}:{size}", shards=1, default_env_limit=10**9)
            await q.load_scripts()
            t = time.perf_counter()
            await fill(q, size, "r")
            fill_s = time.perf_counter() - t
            await measure(q, 50)  # warm-up
            costs = await measure(q, samples)
            mem = (await client.info("memory"))["used_memory"] / 2**20
            results[size] = median(costs)
            print(f"{size:>10}{fill_s:>9.1f}{median(costs):>10.1f}{pct(costs, 99):>10.1f}{mem:>10.0f}")
            await delete_prefix(redis_url, f"{prefix}:{size}:")
    finally:
        await delete_prefix(redis_url, prefix)  # also after an interruption
        await client.aclose()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,100000,1000000")
    parser.add_argument("--samples", type=int, default=500)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results = asyncio.run(main_async(sizes, args.samples, os.environ.get("REDIS_URL", DEFAULT_REDIS)))
    ratio = results[sizes[-1]] / results[sizes[0]]
    print(f"dequeue cost ratio {_label(sizes[-1])}/{_label(sizes[0])}: {ratio:.2f}")


def _label(n: int) -> str:
    for unit, div in (("M", 1_000_000), ("k", 1_000)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


if __name__ == "__main__":
    main()
