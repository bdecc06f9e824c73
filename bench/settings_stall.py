"""A queue's settings written again while thousands of its concurrency keys are parked at their
limit: what it costs the other tenants of the worker group.

    python bench/settings_stall.py [--keys 10000]

One environment's queue has a limit of 1 for each key and ``--keys`` keys with two runs each: one
run of every key is handed out and the keys are parked at their limit (out of the group's index).
Then another environment's run is queued, the queue's settings are written again unchanged (what
every deploy and every repair does), and the group's dequeue calls are counted and timed until that
run is handed out. Last line: ``settings change stall ms: <number>`` (the time until the other
tenant's run was handed out; Redis runs nothing else during each dequeue call).
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

from bench._common import DEFAULT_REDIS, delete_prefix  # noqa: E402
from run_engine.run_queue import EnqueueItem, QueueSettings, RunQueue  # noqa: E402

NOW = 1_700_000_000_000


async def other_tenant_waits(q: RunQueue, run_id: str) -> tuple[int, float, list[float]]:
    """Queue one run of another environment; (dequeue calls, ms, each call's ms) until it is handed."""
    await q.enqueue([EnqueueItem(run_id, "env_b", "task/b", "wg", NOW)], NOW)
    start = time.perf_counter()
    calls: list[float] = []
    while True:
        t = time.perf_counter()
        got = await q.dequeue("wg", 10, NOW + 20)
        calls.append((time.perf_counter() - t) * 1000)
        if any(m.run_id == run_id for m in got):
            return len(calls), (time.perf_counter() - start) * 1000, calls


async def main(args: argparse.Namespace, redis_url: str) -> float:
    prefix = f"stallbench{secrets.token_hex(3)}"
    client = aioredis.Redis.from_url(redis_url)
    try:
        q = RunQueue(client, prefix=prefix, shards=1, default_env_limit=10**6)
        await q.load_scripts()
        await q.set_queue_limit("env_a", "task/a", 1)
        items = [EnqueueItem(f"a{k}_{j}", "env_a", "task/a", "wg", NOW + j, concurrency_key=f"k{k}")
                 for k in range(args.keys) for j in range(2)]
        for start in range(0, len(items), 2000):
            await q.enqueue(items[start:start + 2000], NOW)
        handed = 0
        while got := await q.dequeue("wg", 500, NOW + 10):
            handed += len(got)
        quick = 0
        for i in range(100):  # the keys left are parked by later calls (each call's work is budgeted)
            calls, _, _ = await other_tenant_waits(q, f"warm{i}")
            quick = quick + 1 if calls == 1 else 0
            if quick == 3:
                break
        print(f"{args.keys} keys at their limit, {handed} runs held; the group's index settled")
        calls, idle_ms, _ = await other_tenant_waits(q, "idle")
        print(f"idle: the other tenant's run handed after {calls} dequeue call(s), {idle_ms:.1f} ms")
        t = time.perf_counter()
        await q.configure_queues([QueueSettings("env_a", "task/a", limit=1)])
        write_ms = (time.perf_counter() - t) * 1000
        calls, stall_ms, each = await other_tenant_waits(q, "after")
        print(f"settings written again ({write_ms:.1f} ms): the other tenant's run handed after {calls} dequeue "
              f"call(s), {stall_ms:.1f} ms (calls: {', '.join(f'{c:.1f}' for c in each)} ms)")
        return stall_ms
    finally:
        await client.aclose()
        await delete_prefix(redis_url, prefix)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=10_000)
    ns = parser.parse_args()
    stall = asyncio.run(main(ns, os.environ.get("REDIS_URL", DEFAULT_REDIS)))
    print(f"settings change stall ms: {stall:.1f}")
