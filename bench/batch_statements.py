"""What the engine's batch statements cost per run as their batches grow: trigger (one insert and one
Lua call for many runs), dequeue with start (one statement and one Lua call per batch) and complete
(transition_many: one statement for all the completions that arrive together), in process, one
batch at a time, on real PostgreSQL and Redis.

    python bench/batch_statements.py [--runs 2000] [--sizes 20,100,200]

Per batch size and operation: PostgreSQL's CPU (all its processes), Redis's (redis-server) and the
engine's, each in µs per run, from /proc (10 ms ticks: ±5 µs per run at 2,000 runs). A
statement whose cost per run grows with its batch is doing n² work somewhere (a join of two CTEs
planned as a nested loop did: 340 µs of PostgreSQL per completed run at 200 a batch, 160 after).
Keep the machine otherwise idle. Last line: ``batch statements pg us/run: <size>=<trigger+dequeue+
complete> ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import secrets
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import DEFAULT_REDIS, cpu_s, delete_prefix, fresh_database, pids_named, postgres_cpu  # noqa: E402
from run_engine.engine import RunEngine, TaskSpec, TriggerRequest  # noqa: E402
from run_engine.settings import EngineSettings  # noqa: E402
from run_engine.tenancy import ensure_environment  # noqa: E402


def engine_cpu_us() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return (ru.ru_utime + ru.ru_stime) * 1e6


def read() -> tuple[float, float, float]:
    redis_s = sum(cpu_s(p, children=True) for p in pids_named("redis-server"))
    return postgres_cpu() * 1e6, redis_s * 1e6, engine_cpu_us()


async def measure(size: int, runs: int, database_url: str, redis_url: str) -> dict[str, tuple[float, float, float]]:
    prefix = f"rebench{secrets.token_hex(3)}"
    engine = await RunEngine.create(EngineSettings(database_url=database_url, redis_url=redis_url, key_prefix=prefix,
                                                   env_concurrency=runs))
    costs = {op: [0.0, 0.0, 0.0] for op in ("trigger", "dequeue", "complete")}

    def add(op: str, before: tuple[float, float, float]) -> None:
        after = read()
        for i in range(3):
            costs[op][i] += after[i] - before[i]

    try:
        env = await ensure_environment(engine.resources.repo, secret="bench", org="bench", project="bench",
                                       concurrency_limit=runs)
        dep_id, _ = await engine.register_deployment(env_id=env.env_id, worker_group_id=env.worker_group_id,
                                                     version="1", content_hash="bench", tasks=[TaskSpec("noop")])
        done = 0
        while done < runs:
            n = min(size, runs - done)
            before = read()
            await engine.trigger_many([TriggerRequest(env_id=env.env_id, task_id="noop", payload={"i": done + i})
                                       for i in range(n)])
            add("trigger", before)
            before = read()
            taken: list[Any] = []
            while len(taken) < n:  # the dequeue hands out at most 100 a call
                got = await engine.dequeue(env.worker_group_id, min(n - len(taken), 100), deployments=[dep_id],
                                           start=True)
                if not got:
                    raise RuntimeError(f"dequeued {len(taken)} of {n} triggered runs")
                taken += got
            add("dequeue", before)
            before = read()
            # completions that arrive together: the engine's batcher makes them one statement
            await asyncio.gather(*(engine.complete_attempt(d.run.id, d.started.snapshot.id, ok=True,
                                                           output={"ok": True}) for d in taken if d.started))
            add("complete", before)
            done += n
    finally:
        await engine.close()
        await delete_prefix(redis_url, prefix)
    return {op: (c[0] / runs, c[1] / runs, c[2] / runs) for op, c in costs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000, help="runs per batch size")
    parser.add_argument("--sizes", default="20,100,200", help="batch sizes, comma-separated")
    args = parser.parse_args()
    redis_url = os.environ.get("REDIS_URL", DEFAULT_REDIS)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"{'batch':>6} {'operation':<10}{'postgres':>10}{'redis':>8}{'engine':>8}   (CPU µs per run)")
    totals = []
    for size in sizes:
        with fresh_database() as database_url:
            costs = asyncio.run(measure(size, args.runs, database_url, redis_url))
        for op, (pg, rd, eng) in costs.items():
            print(f"{size:>6} {op:<10}{pg:>10.0f}{rd:>8.0f}{eng:>8.0f}")
        totals.append(f"{size}={sum(c[0] for c in costs.values()):.0f}")
    print("batch statements pg us/run: " + " ".join(totals))


if __name__ == "__main__":
    main()
