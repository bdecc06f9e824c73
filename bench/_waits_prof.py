"""Waits: many runs each waiting on its own token, against a real `run-engine server` and supervisor.

    python bench/waits.py [--runs 10000] [--concurrency 32] [--suspend-after 0.1]

1. creates one token per run, then batch-triggers the runs (1,000 per request); each run waits on
   its token, and the supervisor suspends it after `--suspend-after` seconds;
2. once every run is suspended, prints the executor processes alive, the runs holding an executor
   and the concurrency slots in use (target: none held);
3. completes every token over HTTP and waits until every run has been restored by replay and
   completed. Last line: ``waits resumed/s: <n>`` (runs completed per second in step 3).

Steps 1 and 3 also print the CPU milliseconds per run each process spent in them (server,
supervisor, executors, PostgreSQL, Redis, this load generator), read from /proc: steadier than
runs/s on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg

ROOT = Path(__file__).resolve().parent.parent
CPUS = os.cpu_count() or 1
sys.path.insert(0, str(ROOT))

from bench._common import (  # noqa: E402
    DEFAULT_REDIS,
    cpu_s,
    delete_prefix,
    executor_pids,
    fresh_database,
    machine_busy_s,
    pids_named,
    postgres_cpu,
    tree_cpu,
    wait_healthy,
)
from bench.http_e2e import RawClient, free_port  # noqa: E402
from bench.per_run_costs import executor_cpu  # noqa: E402


def count(database_url: str, sql: str) -> int:
    with psycopg.connect(database_url) as conn:
        row = conn.execute(sql).fetchone()
    return int(row[0]) if row else 0


async def post_all(url: str, key: str, bodies: list[tuple[str, bytes]], clients: int) -> list[bytes]:
    """POST every (path, body) with `clients` keep-alive connections (the cheap client of
    bench/http_e2e.py: on two cores the load generator competes with what it measures)."""
    host, port = url.removeprefix("http://").split(":")
    results: list[bytes] = [b""] * len(bodies)
    items = iter(range(len(bodies)))

    async def worker() -> None:
        client = RawClient(host, int(port), key)
        try:
            for i in items:
                status, body = await client.post(*bodies[i])
                if status != 200:
                    raise RuntimeError(f"{bodies[i][0]} answered {status}: {body[:200]!r}")
                results[i] = body
        finally:
            await client.close()

    await asyncio.gather(*(worker() for _ in range(clients)))
    return results


async def until(predicate, what: str, timeout_s: float, every_s: float = 0.5) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    last = -1.0
    while not predicate():
        now = time.perf_counter() - start
        if now > timeout_s:
            raise SystemExit(f"timed out after {timeout_s:.0f}s waiting for {what}")
        if now - last >= 5:
            last = now
            print(f"  … {what}: {now:.0f}s", flush=True)
        await asyncio.sleep(every_s)
    return time.perf_counter() - start


def cpu_now(server: int, supervisor: int) -> dict[str, Any]:
    return {"server": tree_cpu(server), "supervisor": cpu_s(supervisor), "executor_pids": executor_cpu(supervisor),
            "postgres": postgres_cpu(), "redis": sum(cpu_s(p) for p in pids_named("redis-server")),
            "load": cpu_s(os.getpid()), "machine": machine_busy_s(), "at": time.monotonic()}


def print_cpu(phase: str, before: dict[str, Any], after: dict[str, Any], n: int) -> None:
    """CPU ms per run of each process over a phase; executors the pool started in the phase
    (imports, ~0.1-0.3 s each) are shown apart: the others' figures are steady costs per run."""
    was, now = before["executor_pids"], after["executor_pids"]
    per_run = {k: (after[k] - before[k]) * 1000 / n for k in before if k not in ("executor_pids", "machine", "at")}
    per_run["executors"] = sum(v - was.get(p, 0.0) for p, v in now.items() if p in was) * 1000 / n
    started = [p for p in now if p not in was]
    parts = "  ".join(f"{k} {v:.2f}" for k, v in per_run.items())
    print(f"  {phase} CPU ms/run: {parts}  total {sum(per_run.values()):.2f}"
          f"  (+ {len(started)} executors started: {sum(now[p] for p in started) * 1000 / n:.2f}); all CPUs "
          f"{(after['machine'] - before['machine']) / (after['at'] - before['at']) / CPUS:.0%} busy", flush=True)


async def bench(args: argparse.Namespace, url: str, key: str, database_url: str, server_pid: int,
                supervisor_pid: int) -> float:
    n = args.runs
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120,
                                 limits=httpx.Limits(max_connections=args.clients + 4)) as client:
        t0 = time.perf_counter()
        created = await post_all(url, key, [("/api/v1/waitpoints/tokens", b'{"tags": ["bench"]}')] * n, args.clients)
        tokens = [json.loads(body)["id"] for body in created]
        print(f"created {n} tokens in {time.perf_counter() - t0:.1f}s", flush=True)

        t0 = time.perf_counter()
        cpu0 = cpu_now(server_pid, supervisor_pid)
        for start in range(0, n, 1000):
            items = [{"task": "wait-token", "payload": {"token": t}} for t in tokens[start:start + 1000]]
            r = await client.post("/api/v1/tasks/batch", json={"items": items})
            r.raise_for_status()
        await until(lambda: count(database_url, "SELECT count(DISTINCT run_id) FROM task_run_checkpoint") >= n,
                    "all runs suspended", args.timeout)
        suspend_s = time.perf_counter() - t0
        print(f"triggered {n} runs; all waiting and suspended after {suspend_s:.1f}s ({n / suspend_s:.0f} runs/s)")
        print_cpu("trigger + wait + suspend", cpu0, cpu_now(server_pid, supervisor_pid), n)

        queue = (await client.get("/api/v1/queues/task/wait-token")).json()
        waiting = count(database_url, "SELECT count(*) FROM task_run WHERE status = 'WAITING'")
        executors = len(executor_pids(supervisor_pid))
        print(f"while all {waiting} runs wait: executor processes alive {executors} (idle in the pool), "
              f"runs holding an executor or slot {queue['running']}, concurrency slots in use {queue['running']}")

        done_before = count(database_url, "SELECT count(*) FROM task_run WHERE status = 'COMPLETED'")
        assert done_before == 0, done_before

        bodies = [(f"/api/v1/waitpoints/tokens/{t}/complete", b'{"data": %d}' % i) for i, t in enumerate(tokens)]
        t0 = time.perf_counter()
        cpu0 = cpu_now(server_pid, supervisor_pid)
        await post_all(url, key, bodies, args.clients)
        completed_tokens_s = time.perf_counter() - t0
        await until(lambda: count(database_url, "SELECT count(*) FROM task_run WHERE status = 'COMPLETED'") >= n,
                    "all runs resumed and completed", args.timeout, every_s=0.2)
        resume_s = time.perf_counter() - t0
        print_cpu("complete token + restore + complete run", cpu0, cpu_now(server_pid, supervisor_pid), n)
        wrong = count(database_url, "SELECT count(*) FROM task_run WHERE status = 'COMPLETED' "
                                    "AND (output->>'got')::int IS NULL")
        restored = count(database_url, "SELECT count(*) FROM task_run WHERE attempt_number = 1")
    print(f"completed {n} tokens in {completed_tokens_s:.1f}s; all {n} runs resumed by replay and completed "
          f"{resume_s:.1f}s after the first completion (outputs missing: {wrong}; still attempt 1: {restored})")
    return n / resume_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--suspend-after", type=float, default=0.1)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    redis_url = os.environ.get("REDIS_URL", DEFAULT_REDIS)
    prefix = f"rewait{secrets.token_hex(3)}"
    port = free_port()
    with fresh_database() as database_url:
        env = {**os.environ, "DATABASE_URL": database_url, "REDIS_URL": redis_url, "RUN_ENGINE_KEY_PREFIX": prefix,
               "RUN_ENGINE_SECRET": "bench-secret-not-for-production", "PYTHONPATH": str(ROOT),
               "RUN_ENGINE_LOG_LEVEL": "WARNING", "RUN_ENGINE_ENV_CONCURRENCY": "1000",
               "RUN_ENGINE_SUSPEND_AFTER_S": str(args.suspend_after),
               "RUN_ENGINE_API_RATE_LIMIT": "0"}  # a throughput measurement: the per-key request limit off
        cli = [sys.executable, "-m", "run_engine.cli"]
        creds = json.loads(subprocess.run([*cli, "bootstrap", "--org", "bench", "--project", "waits"], env=env,
                                          capture_output=True, text=True, check=True).stdout)
        url = f"http://127.0.0.1:{port}"
        procs = [subprocess.Popen([sys.executable, "-m", "cProfile", "-o", "/tmp/prof/server.prof", "-m", "run_engine.cli", "server", "--port", str(port)], env=env)]
        try:
            supervisor = subprocess.Popen([*cli, "supervisor", "--token", creds["workerGroupToken"], "--tasks",
                                           "bench.tasks_http", "--api-url", url, "--concurrency",
                                           str(args.concurrency)], env=env, cwd=ROOT)
            procs.append(supervisor)
            wait_healthy(url)
            print(f"runs: {args.runs}  supervisor concurrency: {args.concurrency}  "
                  f"suspend after: {args.suspend_after}s  HTTP clients: {args.clients}", flush=True)
            rate = asyncio.run(bench(args, url, creds["apiKey"], database_url, procs[0].pid, supervisor.pid))
        finally:
            for p in reversed(procs):
                p.terminate()
                p.wait(30)
            asyncio.run(delete_prefix(redis_url, prefix))
    print(f"waits resumed/s: {rate:.0f}")


if __name__ == "__main__":
    main()
