"""What a page of runs with large payloads costs PostgreSQL: `GET /api/v1/runs` (and a bulk replay's
page) keeps runs within 16 MiB of payload, output and metadata, so it must know their sizes.

    python bench/page_bytes.py [--runs 100] [--payload-mb 3] [--pages 5]

Triggers N runs whose payloads are M MiB of JSON text each (compressible, as logs and documents are:
PostgreSQL stores them in a fraction of that), then reads the first page of 100 runs P times and
prints the median milliseconds a page and PostgreSQL's CPU milliseconds a page (from /proc). Last
line: ``page ms: <n>``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "peers"))

from cpu import Servers, snapshot  # noqa: E402

from bench._common import DEFAULT_REDIS, delete_prefix, fresh_database  # noqa: E402
from run_engine.engine import PAGE_BYTES, RunEngine, TriggerRequest  # noqa: E402
from run_engine.settings import EngineSettings  # noqa: E402
from run_engine.tenancy import ensure_environment  # noqa: E402


async def measure(database_url: str, runs: int, payload_mb: float, pages: int) -> tuple[float, float, int]:
    prefix = f"repage{os.getpid()}"
    redis_url = os.environ.get("REDIS_URL", DEFAULT_REDIS)
    engine = await RunEngine.create(EngineSettings(database_url=database_url, redis_url=redis_url, key_prefix=prefix,
                                                   max_payload_bytes=int((payload_mb + 1) * 1024 * 1024)),
                                    run_jobs=False)
    try:
        env = await ensure_environment(engine.resources.repo, secret="bench-secret-not-for-production",
                                       org="bench", project="pages")
        text = "log line 42: all is well\n" * int(payload_mb * 1024 * 1024 / 25)
        for start in range(0, runs, 10):
            await engine.trigger_many([TriggerRequest(env_id=env.env_id, task_id="noop", payload={"log": text})
                                       for _ in range(start, min(runs, start + 10))])
        times, cpu, kept = [], [], 0
        for _ in range(pages):
            before = snapshot(os.getpid(), Servers())
            t0 = time.perf_counter()
            page, _more = await engine.page_runs(env.env_id, limit=100, max_bytes=PAGE_BYTES)
            times.append((time.perf_counter() - t0) * 1000)
            cpu.append(snapshot(os.getpid(), Servers()).minus(before)["postgres"])
            kept = len(page)
        return statistics.median(times), statistics.median(cpu), kept
    finally:
        await engine.close()
        await delete_prefix(redis_url, prefix)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--payload-mb", type=float, default=3.0)
    parser.add_argument("--pages", type=int, default=5)
    args = parser.parse_args()
    with fresh_database() as database_url:
        ms, pg_ms, kept = asyncio.run(measure(database_url, args.runs, args.payload_mb, args.pages))
    print(f"runs: {args.runs} of {args.payload_mb} MiB; a page keeps {kept}")
    print(f"PostgreSQL CPU ms a page: {pg_ms:.0f}")
    print(f"page ms: {ms:.0f}")


if __name__ == "__main__":
    main()
