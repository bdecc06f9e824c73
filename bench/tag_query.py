"""The runs of a tag in a big environment: what `GET /api/v1/runs?filter[tag]=` and the realtime tag
shape (`/realtime/v1/runs?tags=`, re-read on every change) cost when the tag is rare.

    python bench/tag_query.py [--runs 300000] [--tagged 20] [--neighbour 0] [--shapes]

Fills a fresh database with N runs of one environment (copies of one real run, every 1,000th
tagged `common`, `--tagged` of them tagged `rare`), then times the repository's tag query for
each tag (median of 20), and the query of a live realtime request (only runs changed lately).
``--neighbour M``: another tenant (environment) first gets M runs tagged both `rare` and `common`:
what its runs of the same tags cost this tenant's queries (nothing, when the index keeps each
environment's entries apart). ``--shapes``: every run is also tagged `every`, and the realtime
tag shape's reads (``shape_runs``: a first read and a live one) are timed for each tag.
Last line: ``rare tag query ms: <n>``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import DEFAULT_REDIS, delete_prefix, fresh_database  # noqa: E402
from run_engine.engine import RunEngine, TriggerRequest  # noqa: E402
from run_engine.settings import EngineSettings  # noqa: E402
from run_engine.tenancy import ensure_environment  # noqa: E402


async def measure(database_url: str, runs: int, tagged: int, neighbour: int = 0,
                  shapes: bool = False) -> dict[str, float]:
    prefix = f"retag{os.getpid()}"
    redis_url = os.environ.get("REDIS_URL", DEFAULT_REDIS)
    engine = await RunEngine.create(EngineSettings(database_url=database_url, redis_url=redis_url,
                                                   key_prefix=prefix), run_jobs=False)
    try:
        env = await ensure_environment(engine.resources.repo, secret="bench-secret-not-for-production",
                                       org="bench", project="tags")
        seed = await engine.trigger(TriggerRequest(env_id=env.env_id, task_id="noop", payload={"n": 0}))
        with psycopg.connect(database_url, autocommit=True) as conn:
            if neighbour:  # another tenant's runs of the same tags
                other = await ensure_environment(engine.resources.repo, secret="bench-secret-not-for-production",
                                                 org="bench-neighbour", project="tags")
                conn.execute(
                    """INSERT INTO task_run
                       SELECT p.* FROM task_run r, generate_series(1, %(n)s) g,
                       LATERAL jsonb_populate_record(NULL::task_run, to_jsonb(r) || jsonb_build_object(
                           'id', 'run_noisy' || lpad(g::text, 17, '0'), 'environment_id', %(env)s::text,
                           'created_at', now() - make_interval(secs => g * 0.01),
                           'tags', '{rare,common}'::text[])) p
                       WHERE r.id = %(seed)s""",
                    {"n": neighbour, "env": other.env_id, "seed": seed.id})
            conn.execute(
                # LATERAL: `(f(...)).*` would call f once per column of task_run
                """INSERT INTO task_run
                   SELECT p.* FROM task_run r, generate_series(1, %(n)s) g,
                   LATERAL jsonb_populate_record(NULL::task_run, to_jsonb(r) || jsonb_build_object(
                       'id', 'run_bench' || lpad(g::text, 17, '0'),
                       'created_at', now() - make_interval(secs => g * 0.1),
                       'tags', CASE WHEN g %% %(every)s = 0 THEN '{rare}'::text[]
                                    WHEN g %% 1000 = 0 THEN '{common}'::text[] ELSE '{}'::text[] END
                               || CASE WHEN %(shapes)s THEN '{every}'::text[] ELSE '{}'::text[] END)) p
                   WHERE r.id = %(seed)s""",
                {"n": runs, "every": max(1, runs // tagged), "seed": seed.id, "shapes": shapes})
            conn.execute("ANALYZE task_run")
        since = datetime.now(UTC) - timedelta(days=2)
        out: dict[str, float] = {}
        recent = datetime.now(UTC) - timedelta(seconds=2)  # what a live shape request reads: the changed runs
        for name, tag, after in (("rare", "rare", None), ("common", "common", None), ("live", "common", recent)):
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                found = await engine.list_runs(env.env_id, tags=[tag], created_from=since, limit=500,
                                               updated_after=after)
                times.append((time.perf_counter() - t0) * 1000)
            out[name] = statistics.median(times)
            out[f"{name} found"] = len(found)
        for tag in ("rare", "common", "every") if shapes else ():
            for phase, after in (("first", None), ("live", recent)):
                times = []
                for _ in range(10):
                    t0 = time.perf_counter()
                    read = await engine.shape_runs(env.env_id, tags=[tag], created_from=since, limit=500,
                                                   updated_after=after)
                    times.append((time.perf_counter() - t0) * 1000)
                out[f"shape {tag} {phase}"] = statistics.median(times)
                out[f"shape {tag} {phase} found"] = len(read.runs)
        return out
    finally:
        await engine.close()
        await delete_prefix(redis_url, prefix)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300_000)
    parser.add_argument("--tagged", type=int, default=20)
    parser.add_argument("--neighbour", type=int, default=0,
                        help="runs of another environment tagged with the same tags")
    parser.add_argument("--shapes", action="store_true",
                        help="also tag every run `every` and time the realtime tag shape's reads")
    args = parser.parse_args()
    with fresh_database() as database_url:
        got = asyncio.run(measure(database_url, args.runs, args.tagged, args.neighbour, args.shapes))
    print(f"runs: {args.runs}; rare: {got['rare found']:.0f} found, common: {got['common found']:.0f} found")
    print(f"common tag query ms: {got['common']:.2f}")
    print(f"common tag, changed in the last 2 s (a live shape request), query ms: {got['live']:.2f} "
          f"({got['live found']:.0f} found)")
    for key in sorted(k for k in got if k.startswith("shape ") and not k.endswith("found")):
        print(f"{key} ms: {got[key]:.2f} ({got[key + ' found']:.0f} found)")
    print(f"rare tag query ms: {got['rare']:.2f}")


if __name__ == "__main__":
    main()
