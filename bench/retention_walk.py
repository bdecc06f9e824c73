"""Retention's batches with many finished runs past the age that must stay (here the children of a
parent not finished: its journal's replay reads them), older than the runs that may go.

    python bench/retention_walk.py [--stay 200000] [--doomed 5000] [--batch 1000]

It makes ``--stay`` such children and ``--doomed`` runs that may go (finished later, so a walk from
the index's oldest row passes every child first), as copies of one triggered run in one INSERT each
(a fresh database), then calls ``delete_finished_before`` a batch at a time until the runs that may
go are deleted. Prints the first batch's time and the median of the others (wall ms): each batch
before walked past every child again; with the walks' cursors only the first does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import DEFAULT_REDIS, delete_prefix, fresh_database, median, noop_engine  # noqa: E402
from run_engine.engine import TriggerRequest  # noqa: E402

_COPIES = """
INSERT INTO task_run SELECT (jsonb_populate_record(NULL::task_run, to_jsonb(t) || jsonb_build_object(
    'id', %(prefix)s || g, 'status', 'COMPLETED_SUCCESSFULLY', 'parent_run_id', %(parent)s::text,
    'finished_at', now() - make_interval(days => %(days)s) + g * interval '1 ms'))).*
FROM task_run t, generate_series(1, %(n)s) g WHERE t.id = %(template)s
"""


async def measure(stay: int, doomed: int, batch: int, database_url: str, redis_url: str) -> tuple[float, float, int]:
    engine, env = await noop_engine("retwalk", database_url, redis_url)
    prefix = engine.resources.settings.key_prefix
    try:
        parent, template = await engine.trigger_many([TriggerRequest(env_id=env.env_id, task_id="noop", payload=i)
                                                      for i in range(2)])
        async with engine.resources.repo.pool.connection() as conn:
            await conn.execute(_COPIES, {"prefix": "run_stay_", "parent": parent.id, "days": 400, "n": stay,
                                         "template": template.id})  # the parent is QUEUED: they stay
            await conn.execute(_COPIES, {"prefix": "run_old_", "parent": None, "days": 399, "n": doomed,
                                         "template": template.id})
            await conn.execute("ANALYZE task_run")
        maintenance = engine.resources.repo.maintenance
        if hasattr(maintenance, "rewind"):
            maintenance.rewind()
        times: list[float] = []
        deleted = 0
        while deleted < doomed:
            t0 = time.perf_counter()
            n = await maintenance.delete_finished_before(30 * 86400, batch, engine.resources.queue.remove_many)
            times.append(time.perf_counter() - t0)
            deleted += n
            if n == 0:
                break
        return times[0] * 1000, median(times[1:] or times) * 1000, len(times)
    finally:
        await engine.close()
        await delete_prefix(redis_url, prefix)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stay", type=int, default=200_000)
    ap.add_argument("--doomed", type=int, default=5_000)
    ap.add_argument("--batch", type=int, default=1000)
    args = ap.parse_args()
    redis_url = os.environ.get("REDIS_URL", DEFAULT_REDIS)
    with fresh_database() as url:
        first, rest, batches = asyncio.run(measure(args.stay, args.doomed, args.batch, url, redis_url))
    print(f"{args.stay} runs that stay, {args.doomed} that go, batches of {args.batch}: {batches} batches, "
          f"first {first:.1f} ms, median of the others {rest:.1f} ms")


if __name__ == "__main__":
    main()
