"""What one run costs, over HTTP with a supervisor (the figures docs/SCALING.md plans with):
PostgreSQL commits and rows written, Redis calls by command, HTTP requests by route, and CPU ms in
each process, per run, for N no-op runs at full load (after a warm-up).

    python bench/per_run_costs.py [--runs 3000] [--concurrency 16] [--clients 32]

Two passes on fresh databases: one measures (logs at WARNING), one counts the HTTP requests (the
server's access log at DEBUG, which costs CPU, so its figures are not used otherwise). Redis
figures are read from INFO commandstats, PostgreSQL's from pg_stat_database, CPU from /proc; keep
the machine otherwise idle. Last line: ``per run: <commits> commits, <evalsha> EVALSHA, <http>
HTTP requests, <cpu> CPU ms``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import (  # noqa: E402
    DEFAULT_REDIS,
    cpu_s,
    delete_prefix,
    descendants,
    fresh_database,
    pids_named,
    postgres_cpu,
    tree_cpu,
    wait_healthy,
)
from bench.http_e2e import free_port, trigger_all, wait_done  # noqa: E402


def redis_stats(client: redis.Redis) -> dict[str, int]:
    raw = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in raw.items()}


def pg_stats(database_url: str) -> dict[str, int]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_force_next_flush()")
        row = conn.execute("""SELECT xact_commit, xact_rollback, tup_inserted, tup_updated, tup_deleted,
                                     pg_current_wal_lsn() - '0/0'::pg_lsn
                              FROM pg_stat_database WHERE datname = current_database()""").fetchone()
    assert row is not None
    names = ("commits", "rollbacks", "inserted", "updated", "deleted", "WAL bytes")
    return dict(zip(names, map(int, row), strict=True))


def start(database_url: str, redis_url: str, prefix: str, level: str, port: int, concurrency: int,
          log: Path) -> tuple[list[subprocess.Popen[bytes]], str, str]:
    env = {**os.environ, "DATABASE_URL": database_url, "REDIS_URL": redis_url, "RUN_ENGINE_KEY_PREFIX": prefix,
           "RUN_ENGINE_SECRET": "bench-secret-not-for-production", "PYTHONPATH": str(ROOT),
           "RUN_ENGINE_LOG_LEVEL": level, "RUN_ENGINE_ENV_CONCURRENCY": "1000", "RUN_ENGINE_API_RATE_LIMIT": "0"}
    cli = [sys.executable, "-m", "run_engine.cli"]
    creds = json.loads(subprocess.run([*cli, "bootstrap", "--org", "bench", "--project", "costs"], env=env,
                                      capture_output=True, text=True, check=True).stdout)
    url = f"http://127.0.0.1:{port}"
    out = log.open("wb")
    procs = [subprocess.Popen([*cli, "server", "--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT)]
    procs.append(subprocess.Popen([*cli, "supervisor", "--token", creds["workerGroupToken"], "--tasks",
                                   "bench.tasks_http", "--api-url", url, "--concurrency", str(concurrency)],
                                  env={**env, "RUN_ENGINE_LOG_LEVEL": "WARNING"}, cwd=ROOT))
    wait_healthy(url)
    return procs, url, creds["apiKey"]


async def load(url: str, key: str, n: int, clients: int) -> float:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        t0 = time.perf_counter()
        await trigger_all(url, key, n, clients, None)
        await wait_done(c)
        return time.perf_counter() - t0


def executor_cpu(supervisor: int) -> dict[int, float]:
    """CPU of each process under the supervisor (its executors), by pid."""
    out = {}
    for p in descendants(supervisor)[1:]:
        try:
            out[p] = cpu_s(p, children=True)
        except OSError:
            continue  # exited meanwhile
    return out


def counters(database_url: str, rds: redis.Redis, server: int, supervisor: int) -> dict[str, Any]:
    return {"pg": pg_stats(database_url), "redis": redis_stats(rds), "server": tree_cpu(server),
            "supervisor": cpu_s(supervisor), "executor_pids": executor_cpu(supervisor),
            "postgres": postgres_cpu(), "redis_cpu": sum(cpu_s(p) for p in pids_named("redis-server")),
            "self": cpu_s(os.getpid())}


def run_pass(args: argparse.Namespace, level: str) -> dict[str, Any]:
    redis_url = os.environ.get("REDIS_URL", DEFAULT_REDIS)
    prefix = f"recost{secrets.token_hex(3)}"
    log = Path(f"/tmp/{prefix}.log")
    rds = redis.Redis.from_url(redis_url)
    try:
        with fresh_database() as database_url:
            procs, url, key = start(database_url, redis_url, prefix, level, free_port(), args.concurrency, log)
            try:
                asyncio.run(load(url, key, 200, args.clients))  # warm-up: executors, caches, connections
                time.sleep(1.0)  # let the warm-up's jobs settle before the counters are read
                before = counters(database_url, rds, procs[0].pid, procs[1].pid)
                before["log"] = log.stat().st_size
                elapsed = asyncio.run(load(url, key, args.runs, args.clients))
                after = counters(database_url, rds, procs[0].pid, procs[1].pid)
                with log.open("rb") as f:
                    f.seek(before["log"])
                    lines = f.read().decode(errors="replace").splitlines()
            finally:
                for p in reversed(procs):
                    p.terminate()
                    p.wait(30)
                asyncio.run(delete_prefix(redis_url, prefix))
    finally:
        rds.close()
        log.unlink(missing_ok=True)
    n = args.runs
    # executors started during the measurement count with their whole start-up (imports, ~0.3 s
    # each): shown apart, as the steady cost per run is what the others' figures are
    was, now = before["executor_pids"], after["executor_pids"]
    before["executors"], after["executors"] = 0.0, sum(now[p] - was.get(p, 0.0) for p in now)
    started = [p for p in now if p not in was]
    return {
        "executors started": (len(started), sum(now[p] for p in started) * 1000 / n),
        "runs/s": n / elapsed,
        "pg": {k: (after["pg"][k] - before["pg"][k]) / n for k in after["pg"]},
        "redis": {k: (v - before["redis"].get(k, 0)) / n for k, v in after["redis"].items()
                  if v - before["redis"].get(k, 0) > 0},
        "cpu_ms": {name: (after[key] - before[key]) * 1000 / n for name, key in (
            ("server", "server"), ("supervisor", "supervisor"), ("executors", "executors"),
            ("PostgreSQL", "postgres"), ("Redis", "redis_cpu"), ("load generator", "self"))},
        "http": _requests(lines, n),
    }


def _requests(lines: list[str], n: int) -> dict[str, float]:
    """Requests per run by route, from the access log lines (DEBUG pass only)."""
    counts: collections.Counter[str] = collections.Counter()
    for line in lines:
        m = re.search(r"method=(GET|POST|PUT|DELETE) path=(/[^ ?]*)", line)
        if m:
            path = re.sub(r"/(run|snapshot|waitpoint|batch)_[a-z0-9]+", r"/{\1}", m.group(2))
            counts[f"{m.group(1)} {path}"] += 1
    return {k: v / n for k, v in counts.most_common()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--clients", type=int, default=32)
    args = parser.parse_args()
    measured = run_pass(args, "WARNING")
    counted = run_pass(args, "DEBUG")
    print(f"runs: {args.runs}, {measured['runs/s']:.0f} runs/s (measuring pass)")
    print("PostgreSQL per run: " + ", ".join(f"{k} {v:.2f}" for k, v in measured["pg"].items()))
    calls = measured["redis"]
    top = {k: calls.get(k, 0.0) for k in ("evalsha", "publish")}
    print("Redis round trips per run: " + ", ".join(f"{k} {v:.2f}" for k, v in top.items())
          + f"; commands run inside the scripts: {sum(v for k, v in calls.items() if k not in top):.1f} "
          "(" + ", ".join(f"{k} {v:.1f}" for k, v in sorted(calls.items(), key=lambda kv: -kv[1])[:6]
                          if k not in top) + ")")
    print("CPU ms per run: " + ", ".join(f"{k} {v:.2f}" for k, v in measured["cpu_ms"].items())
          + f" (total {sum(measured['cpu_ms'].values()):.2f})")
    started, startup_ms = measured["executors started"]
    if started:
        print(f"  of the executors' figure, {startup_ms:.2f} ms per run is the start-up of {started} executors "
              "started during the measurement (the pool grew)")
    print("HTTP requests per run: " + ", ".join(f"{k} {v:.2f}" for k, v in counted["http"].items()))
    http = sum(counted["http"].values())
    print(f"per run: {measured['pg']['commits']:.2f} commits, {measured['redis'].get('evalsha', 0):.2f} EVALSHA, "
          f"{http:.2f} HTTP requests, {sum(measured['cpu_ms'].values()):.2f} CPU ms")


if __name__ == "__main__":
    main()
