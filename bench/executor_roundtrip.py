"""The supervisor ↔ executor hand-off alone: a no-op run sent to warm executor processes over their
pipes, its result read back, as the supervisor does it (no server, no database).

    python bench/executor_roundtrip.py [--runs 5000] [--executors 1] [--evict-mb 0]

With ``--evict-mb N`` this process writes one byte per cache line of N MB before each run it
hands out, and each executor is pinned to the CPU this process runs on: every run then starts
with caches another process has filled, as on a machine where the server, PostgreSQL, Redis and
the other executors run between two runs of one executor (a run's CPU is ~6x then: most of an
executor's cost per run in ``bench/waits.py`` is reading back what it touches).

Prints round trips per second and the CPU milliseconds per run of the executors and of this
process (the supervisor's side), read from /proc. Last line: ``executor round trips/s: <n>``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from supervisor.executor import Executor  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(ex: Executor) -> float:
    """CPU seconds the executor's process has used."""
    with open(f"/proc/{ex.process.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


async def measure(runs: int, executors: int, evict_mb: int) -> float:
    pool = [Executor("bench.tasks_http") for _ in range(executors)]
    for ex in pool:
        await ex.ready()
    junk = bytearray(evict_mb << 20)
    ones = b"\x01" * (len(junk) // 64)
    if evict_mb:
        cpu = os.sched_getaffinity(0)
        here = {min(cpu)}
        os.sched_setaffinity(0, here)
        for ex in pool:
            os.sched_setaffinity(ex.process.pid, here)
    msg = {"type": "run", "runId": "run_bench", "task": "noop", "payload": {}, "attempt": 1, "tags": [],
           "queue": "task/noop", "runToken": "rt_bench", "apiUrl": "http://127.0.0.1:1", "journal": []}

    async def drive(ex: Executor, n: int) -> None:
        for _ in range(n):
            if evict_mb:
                junk[::64] = ones
            out = await ex.run(msg, max_duration_s=None, memory_mb=None)
            if not out.get("ok"):
                raise RuntimeError(f"the no-op run failed: {out}")

    try:
        await asyncio.gather(*(drive(ex, 200) for ex in pool))  # warm-up
        per = max(runs // executors, 1)
        before = [cpu_s(ex) for ex in pool]
        mine, began = os.times(), time.perf_counter()
        await asyncio.gather(*(drive(ex, per) for ex in pool))
        elapsed = time.perf_counter() - began
        after = os.times()
        total = per * executors
        spent = sum(cpu_s(ex) - b for ex, b in zip(pool, before, strict=True))
        own = (after.user + after.system) - (mine.user + mine.system)
    finally:
        for ex in pool:
            ex.stop()
    rate = total / elapsed
    print(f"runs: {total}  executors: {executors}")
    print(f"CPU ms per run: executors {spent * 1000 / total:.3f}, supervisor side {own * 1000 / total:.3f}")
    print(f"executor round trips/s: {rate:.0f}")
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5000)
    parser.add_argument("--executors", type=int, default=1)
    parser.add_argument("--evict-mb", type=int, default=0, help="MB written before each run (see above)")
    args = parser.parse_args()
    import uvloop  # the supervisor runs on it

    uvloop.run(measure(args.runs, args.executors, args.evict_mb))


if __name__ == "__main__":
    main()
