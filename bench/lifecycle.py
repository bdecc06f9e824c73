"""Engine lifecycle benchmark: N runs through trigger → dequeue → start → complete, in process,
on real PostgreSQL and Redis, with concurrent producers and consumers.

    python bench/lifecycle.py [--runs 5000] [--consumers 32] [--producers 16] [--batch 20] [--enqueue-first]
                              [--start-in-dequeue]

``--enqueue-first`` triggers all N runs first (the batch trigger, 500 a call), then drains them.

Prints a table (runs/s, CPU ms per run, p50/p99 per operation) and, as its last line,
``lifecycle runs/s: <number>``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import secrets
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import DEFAULT_REDIS, delete_prefix, fresh_database, pct  # noqa: E402
from run_engine.engine import RunEngine, TaskSpec, TriggerRequest  # noqa: E402
from run_engine.settings import EngineSettings  # noqa: E402
from run_engine.tenancy import ensure_environment  # noqa: E402


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def run(args: argparse.Namespace, database_url: str, redis_url: str) -> float:
    prefix = f"rebench{secrets.token_hex(3)}"
    settings = EngineSettings(database_url=database_url, redis_url=redis_url, key_prefix=prefix,
                              env_concurrency=args.concurrency, db_pool_max=args.pool,
                              **({} if args.gc_threshold is None else {"gc_threshold": args.gc_threshold}))
    engine = await RunEngine.create(settings)
    try:
        env = await ensure_environment(engine.resources.repo, secret="bench", org="bench", project="bench",
                                       concurrency_limit=args.concurrency)
        dep_id, _ = await engine.register_deployment(env_id=env.env_id, worker_group_id=env.worker_group_id,
                                                     version="1", content_hash="bench", tasks=[TaskSpec("noop")])
        # a supervisor names its deployment when it dequeues (the rolling-deploy filter)
        deployments = [dep_id] if args.deployment_filter else []
        lat: dict[str, list[float]] = {"trigger": [], "dequeue": [], "start": [], "complete": []}
        done = 0
        produced = asyncio.Event()

        async def producer(count: int) -> None:
            for i in range(count):
                t = time.perf_counter()
                await engine.trigger(TriggerRequest(env_id=env.env_id, task_id="noop", payload={"i": i}))
                lat["trigger"].append(time.perf_counter() - t)

        async def execute(d) -> None:  # type: ignore[no-untyped-def]
            nonlocal done
            t = time.perf_counter()
            s = d.started or await engine.start_attempt(d.run.id, d.snapshot.id)
            t2 = time.perf_counter()
            await engine.complete_attempt(d.run.id, s.snapshot.id, ok=True, output={"ok": True})
            t3 = time.perf_counter()
            lat["start"].append(t2 - t)
            lat["complete"].append(t3 - t2)
            done += 1

        async def consumer() -> None:
            idle = 0.001
            while done < args.runs:
                t = time.perf_counter()
                got = await engine.dequeue(env.worker_group_id, args.batch, deployments=deployments,
                                           start=args.start_in_dequeue)
                if not got:
                    if produced.is_set() and done >= args.runs:
                        return
                    await asyncio.sleep(idle)  # back off while the queue is empty
                    idle = min(idle * 2, 0.02)
                    continue
                idle = 0.001
                lat["dequeue"].append(time.perf_counter() - t)
                await asyncio.gather(*(execute(d) for d in got))

        per = args.runs // args.producers
        counts = [per + (1 if i < args.runs % args.producers else 0) for i in range(args.producers)]
        cpu0, t0 = cpu_s(), time.perf_counter()
        if args.enqueue_first:  # all runs triggered in batches of 500 (one insert, one Lua call each), then drained
            for start in range(0, args.runs, 500):
                t = time.perf_counter()
                await engine.trigger_many([TriggerRequest(env_id=env.env_id, task_id="noop", payload={"i": i})
                                           for i in range(start, min(args.runs, start + 500))])
                lat["trigger"].append(time.perf_counter() - t)
            produced.set()
            await asyncio.gather(*(consumer() for _ in range(args.consumers)))
        else:
            prod = asyncio.gather(*(producer(c) for c in counts))
            cons = asyncio.gather(*(consumer() for _ in range(args.consumers)))
            await prod
            produced.set()
            await cons
        elapsed = time.perf_counter() - t0
        cpu = cpu_s() - cpu0
    finally:
        await engine.close()
        await delete_prefix(redis_url, prefix)

    rate = args.runs / elapsed
    print(f"runs: {args.runs}  producers: {args.producers}  consumers: {args.consumers}  "
          f"dequeue batch: {args.batch}  cores: {os.cpu_count()}")
    print(f"{'elapsed s':<22}{elapsed:>10.2f}")
    print(f"{'runs/s':<22}{rate:>10.0f}")
    print(f"{'engine CPU ms per run':<22}{cpu * 1000 / args.runs:>10.3f}")
    print(f"{'operation':<12}{'count':>8}{'p50 ms':>10}{'p99 ms':>10}")
    for name, values in lat.items():
        print(f"{name:<12}{len(values):>8}{pct(values, 50) * 1000:>10.2f}{pct(values, 99) * 1000:>10.2f}")
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5000)
    parser.add_argument("--producers", type=int, default=16)
    parser.add_argument("--consumers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=1000)
    parser.add_argument("--pool", type=int, default=8)
    parser.add_argument("--gc-threshold", type=int, default=None,
                        help="the collector's youngest-generation threshold (default: the engine's, 10,000; "
                             "0: CPython's own, 700)")
    parser.add_argument("--enqueue-first", action="store_true",
                        help="trigger every run first (batches of 500), then drain: the peers' batch mode")
    parser.add_argument("--start-in-dequeue", action="store_true",
                        help="the dequeue starts the attempts in its own transaction (what the supervisor asks "
                             "for over HTTP) instead of one start call per run")
    parser.add_argument("--deployment-filter", action=argparse.BooleanOptionalAction, default=True,
                        help="dequeue as a supervisor does, naming its deployment (only its tasks' runs)")
    args = parser.parse_args()
    redis_url = os.environ.get("REDIS_URL", DEFAULT_REDIS)
    with fresh_database() as database_url:
        rate = asyncio.run(run(args, database_url, redis_url))
    print(f"lifecycle runs/s: {rate:.0f}")


if __name__ == "__main__":
    main()
