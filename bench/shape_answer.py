"""What a realtime shape answer holds in memory: `GET /realtime/v1/batches/{id}` (the SDK's
`runs.subscribeToBatch`) over a batch whose runs carry large metadata, followed as the SDK follows it
(the answer's offset, until up-to-date).

    python bench/shape_answer.py [--runs 1000] [--metadata-kb 256] [--answer-mb 8]

Triggers a batch of N runs, gives each M KiB of metadata, then reads the shape through the API in
process and prints how many answers it took, the largest answer in MB, the server process's peak
resident memory growth while reading, and the milliseconds for the whole initial sync. With
``--answer-mb 0`` an answer is unbounded (every run in one, as before answers were bounded).
Last line: ``shape largest answer MB: <n>``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import DEFAULT_REDIS, delete_prefix, fresh_database  # noqa: E402
from run_engine.api import shape_stream  # noqa: E402
from run_engine.api.app import create_app  # noqa: E402
from run_engine.api.context import ApiContext  # noqa: E402
from run_engine.engine import RunEngine, TriggerRequest  # noqa: E402
from run_engine.run_tokens import RunTokens  # noqa: E402
from run_engine.settings import EngineSettings  # noqa: E402
from run_engine.tenancy import ensure_environment  # noqa: E402
from run_engine.wakeups import WakeUps  # noqa: E402

SECRET = "bench-secret-not-for-production"


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def measure(database_url: str, runs: int, metadata_kb: int) -> tuple[int, float, float, float]:
    prefix = f"reshape{os.getpid()}"
    redis_url = os.environ.get("REDIS_URL", DEFAULT_REDIS)
    engine = await RunEngine.create(EngineSettings(database_url=database_url, redis_url=redis_url, key_prefix=prefix),
                                    run_jobs=False)
    try:
        env = await ensure_environment(engine.resources.repo, secret=SECRET, org="bench", project="shapes")
        batch_id = engine.new_batch_id()
        made = await engine.trigger_batch(env.env_id, batch_id, [
            TriggerRequest(env_id=env.env_id, task_id="noop", payload={"i": i}, batch_id=batch_id)
            for i in range(runs)])
        text = "m" * (metadata_kb * 1024 - 16)
        for run in made:
            await engine.set_metadata(env.env_id, run.id, {"text": text})
        ctx = ApiContext(engine=engine, tokens=RunTokens(SECRET),
                         wakeups=WakeUps(engine.redis, channel=f"{prefix}:wake"), public_url="http://bench",
                         secret=SECRET)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)), base_url="http://bench",
                                     headers={"Authorization": f"Bearer {env.api_key}"}, timeout=600) as client:
            rss_before = peak_rss_mb()
            t0 = time.perf_counter()
            offset, answers, largest, seen = "-1", 0, 0, 0
            while True:
                answer = await client.get(f"/realtime/v1/batches/{batch_id}", params={"offset": offset})
                answer.raise_for_status()
                answers += 1
                largest = max(largest, len(answer.content))
                body = answer.json()
                seen += sum(1 for m in body if "value" in m)
                offset = answer.headers["electric-offset"]
                if body and body[-1] == shape_stream.UP_TO_DATE:
                    break
                del body, answer
            elapsed_ms = (time.perf_counter() - t0) * 1000
            assert seen == runs, (seen, runs)
            return answers, largest / 1024 / 1024, peak_rss_mb() - rss_before, elapsed_ms
    finally:
        await engine.close()
        await delete_prefix(redis_url, prefix)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--metadata-kb", type=int, default=256)
    parser.add_argument("--answer-mb", type=float, default=8, help="0: unbounded (every run in one answer)")
    args = parser.parse_args()
    shape_stream.ANSWER_BYTES = int(args.answer_mb * 1024 * 1024) if args.answer_mb else 2**62
    with fresh_database() as database_url:
        answers, largest_mb, rss_mb, ms = asyncio.run(measure(database_url, args.runs, args.metadata_kb))
    print(f"runs: {args.runs} with {args.metadata_kb} KiB of metadata; answers: {answers}")
    print(f"peak RSS growth MB: {rss_mb:.0f}; initial sync ms: {ms:.0f}")
    print(f"shape largest answer MB: {largest_mb:.1f}")


if __name__ == "__main__":
    main()
