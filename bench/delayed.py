"""Delayed runs coming due: how fast the engine jobs move them from DELAYED to QUEUED. In process,
real PostgreSQL and Redis, no consumers (only the delays' jobs run).

    python bench/delayed.py [--runs 20000] [--rounds 2]

Each round triggers ``--runs`` runs delayed until one instant a little after the last is triggered,
then waits until the run queue holds them all. Prints, per round, the runs enqueued per second from
that instant and the CPU milliseconds per run of this process, PostgreSQL and Redis in that window
(read from /proc). Last line: ``delayed enqueued/s: N`` (the best round).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import DEFAULT_REDIS, cpu_s, delete_prefix, fresh_database, pids_named, postgres_cpu  # noqa: E402
from run_engine.engine import RunEngine, TaskSpec, TriggerRequest  # noqa: E402
from run_engine.settings import EngineSettings  # noqa: E402
from run_engine.tenancy import ensure_environment  # noqa: E402


def _cpu() -> dict[str, float]:
    return {"engine": cpu_s(os.getpid()), "postgres": postgres_cpu(),
            "redis": sum(cpu_s(p) for p in pids_named("redis-server"))}


async def one_round(args: argparse.Namespace, redis_url: str) -> float:
    prefix = f"redelay{secrets.token_hex(3)}"
    with fresh_database() as database_url:
        settings = EngineSettings(database_url=database_url, redis_url=redis_url, key_prefix=prefix,
                                  max_queue_length=None, env_concurrency=100_000)
        engine = await RunEngine.create(settings)
        try:
            env = await ensure_environment(engine.resources.repo, secret="bench", org="bench", project="delay",
                                           env="a", concurrency_limit=100_000)
            await engine.register_deployment(env_id=env.env_id, worker_group_id=env.worker_group_id, version="1",
                                             content_hash="delay", tasks=[TaskSpec("noop")])
            lead_s = 5.0 + args.runs / 2000  # time to trigger them all first
            due = datetime.now(UTC) + timedelta(seconds=lead_s)
            for start in range(0, args.runs, 500):
                await engine.trigger_many([TriggerRequest(env_id=env.env_id, task_id="noop", delay_until=due)
                                           for _ in range(start, min(args.runs, start + 500))])
            wait = due.timestamp() - time.time()
            if wait < 0:
                raise RuntimeError(f"triggering took longer than the lead of {lead_s:.0f} s: raise it")
            await asyncio.sleep(wait)
            before, t0 = _cpu(), time.perf_counter()
            queue = engine.resources.queue
            deadline = t0 + 900
            while (await queue.env_stats(env.env_id)).queued < args.runs:
                if time.perf_counter() > deadline:
                    raise TimeoutError("the delayed runs were not all enqueued within 900 s")
                await asyncio.sleep(0.02)
            elapsed = time.perf_counter() - t0
            after = _cpu()
        finally:
            await engine.close()
            await delete_prefix(redis_url, prefix)
    per_run = {k: (after[k] - before[k]) * 1000 / args.runs for k in before}
    rate = args.runs / elapsed
    print(f"{args.runs} delayed runs enqueued in {elapsed:.2f} s: {rate:.0f}/s; CPU ms per run: "
          + ", ".join(f"{k} {v:.3f}" for k, v in per_run.items()) + f", total {sum(per_run.values()):.3f}")
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    redis_url = os.environ.get("REDIS_URL", DEFAULT_REDIS)
    best = max(asyncio.run(one_round(args, redis_url)) for _ in range(args.rounds))
    print(f"delayed enqueued/s: {best:.0f}")


if __name__ == "__main__":
    main()
