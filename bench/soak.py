"""Soak: a long steady load with waits and retries in the mix, watching every process for leaks.

    python bench/soak.py [--minutes 30] [--rate 0] [--seed 1]

The installation of bench/chaos.py (embedded PostgreSQL and Redis, two servers, three
supervisors) without faults, and its mix of runs (plain, retried, journaled steps around waits,
tokens completed from outside, trigger_and_wait and batch parents, delayed, TTL, cancels). It first
measures the mix's capacity (2,000 runs sent as fast as they are accepted, runs/s until the last
finished), then triggers the mix at half of it (``--rate`` to set it). Each minute it samples the
resident memory and open file descriptors of every process and prints them. At the end every run
must have finished (the chaos checks run too).
Last line: ``soak rss growth %: N``, the growth of the run-engine processes' memory (servers,
supervisors, executors) between minute 5 and the end (target ≤ 10).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.chaos import (  # noqa: E402
    Api,
    Installation,
    drive,
    explain,
    installed,
    judge,
    observe,
    plan,
    unfinished,
)

GROUPS = ("servers", "supervisors", "executors", "redis", "postgres")


def processes(inst: Installation) -> dict[str, list[psutil.Process]]:
    def of(pid: int | None, children: bool = False) -> list[psutil.Process]:
        if pid is None:
            return []
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            return [p, *p.children(recursive=True)] if children else [p]
        return []

    pg_pid = inst.pg._pid()
    return {
        "servers": [p for s in inst.servers for p in of(s.proc.pid if s.proc else None)],
        "supervisors": [p for s in inst.supervisors for p in of(s.proc.pid if s.proc else None)],
        "executors": [c for s in inst.supervisors for c in s.children()],
        "redis": of(inst.redis._proc.pid if inst.redis._proc else None),
        "postgres": of(pg_pid, children=True),
    }


def sample(inst: Installation) -> dict[str, tuple[float, int, int]]:
    """group → (RSS MB, open fds, processes)."""
    out = {}
    for group, procs in processes(inst).items():
        rss = fds = n = 0
        for p in procs:
            with contextlib.suppress(psutil.Error):
                rss += p.memory_info().rss
                fds += p.num_fds()
                n += 1
        out[group] = (rss / 2**20, fds, n)
    return out


async def finished_all(inst: Installation, timeout_s: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await loop.run_in_executor(None, unfinished, inst.pg.url) == 0:
            return True
        await asyncio.sleep(1)
    return False


async def calibrate(inst: Installation, api: Api, seed: int, runs: int) -> float:
    """The mix's capacity: ``runs`` of it sent as fast as they are accepted, runs finished per
    second until the last one finished."""
    t0 = time.monotonic()
    await drive(api, plan(seed, runs), rate=10_000)
    if not await finished_all(inst, 600):
        raise SystemExit("calibration runs did not finish within 10 minutes")
    return runs / (time.monotonic() - t0)


async def run(args: argparse.Namespace) -> float:
    async with installed("soak-", args.executors, args.seed, args.keep) as (inst, api):
        rate = args.rate
        if not rate:
            measured = await calibrate(inst, api, args.seed + 1000, args.calibration_runs)
            rate = measured / 2
            print(f"the mix runs at {measured:.0f} runs/s at most: soaking at {rate:.0f}/s", flush=True)
        specs = plan(args.seed, int(rate * args.minutes * 60))
        load = asyncio.create_task(drive(api, specs, rate))
        print(f"{'min':>4} " + " ".join(f"{g + ' MB':>15} {'fds':>5}" for g in GROUPS), flush=True)
        samples: list[dict[str, tuple[float, int, int]]] = []
        t0 = time.monotonic()
        for minute in range(args.minutes + 1):
            await asyncio.sleep(max(0.0, t0 + minute * 60 - time.monotonic()))
            s = sample(inst)
            samples.append(s)
            print(f"{minute:>4} " + " ".join(f"{s[g][0]:>15.1f} {s[g][1]:>5}" for g in GROUPS), flush=True)
        await load
        if not await finished_all(inst, 600):
            print("runs still not finished 10 minutes after the load ended")
        verdict = judge(specs, await observe(inst, api))
        await explain(api, verdict)
        print(f"runs {len(specs)}: lost {len(verdict.lost)}, duplicated {len(verdict.duplicated)}, "
              f"stuck {len(verdict.stuck)}, wrong {len(verdict.wrong)}")
        for line in (verdict.lost + verdict.duplicated + verdict.stuck + verdict.wrong)[:20]:
            print(f"  {line}")

        def engine_rss(s: dict[str, tuple[float, int, int]]) -> float:
            return sum(s[g][0] for g in ("servers", "supervisors", "executors"))

        start = samples[min(5, len(samples) - 1)]
        growth = (engine_rss(samples[-1]) / engine_rss(start) - 1) * 100
        fds = sum(samples[-1][g][1] for g in ("servers", "supervisors", "executors")) - \
            sum(start[g][1] for g in ("servers", "supervisors", "executors"))
        print(f"run-engine processes: {engine_rss(start):.0f} MB at minute {min(5, len(samples) - 1)}, "
              f"{engine_rss(samples[-1]):.0f} MB at the end; open fds {fds:+d}")
        print(f"soak rss growth %: {growth:.1f}", flush=True)
        return growth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=int, default=30)
    parser.add_argument("--rate", type=float, default=0.0, help="triggers per second (0: half the measured rate)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--calibration-runs", type=int, default=2000)
    parser.add_argument("--executors", type=int, default=6, help="per supervisor")
    parser.add_argument("--keep", action="store_true")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
