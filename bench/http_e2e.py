"""HTTP end to end: runs triggered over HTTP and executed by a real supervisor with warm
executors, against a real `run-engine server` process.

    python bench/http_e2e.py [--runs 3000] [--concurrency 16] [--clients 32]

Full load: triggers as fast as `--clients` concurrent HTTP clients can, until all runs finish.
Half load: triggers at half the measured rate. For both it prints throughput and trigger→start
latency (trigger call sent → the run's startedAt) p50/p99. Last line: ``http e2e runs/s: <n>``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import DEFAULT_REDIS, delete_prefix, fresh_database, pct, wait_healthy  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RawClient:
    """A minimal keep-alive HTTP/1.1 client for the load itself: on two cores the load generator
    competes with what it measures, and httpx costs several times more CPU per request."""

    def __init__(self, host: str, port: int, key: str) -> None:
        self.host, self.port, self.key = host, port, key
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer {self.key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()


async def trigger_all(url: str, key: str, n: int, clients: int, rate: float | None) -> dict[str, float]:
    """Trigger n runs; returns run id → wall time the trigger was sent."""
    sent: dict[str, float] = {}
    counter = iter(range(n))
    start = time.time()
    host, port = url.removeprefix("http://").split(":")

    async def worker() -> None:
        client = RawClient(host, int(port), key)
        try:
            for i in counter:
                if rate:
                    delay = start + i / rate - time.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                t = time.time()
                status, body = await client.post("/api/v1/tasks/noop/trigger", b'{"payload": {"i": %d}}' % i)
                if status != 200:
                    raise RuntimeError(f"trigger answered {status}: {body[:200]!r}")
                sent[json.loads(body)["id"]] = t
        finally:
            await client.close()

    await asyncio.gather(*(worker() for _ in range(clients)))
    return sent


async def wait_done(client: httpx.AsyncClient) -> None:
    while True:
        q = (await client.get("/api/v1/queues/task/noop")).json()
        if q["queued"] == 0 and q["running"] == 0:
            return
        await asyncio.sleep(0.05)


async def started_at(client: httpx.AsyncClient, ids: set[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    after = None
    while True:
        params = {"page[size]": "100", "filter[taskIdentifier]": "noop"}
        if after:
            params["page[after]"] = after
        page = (await client.get("/api/v1/runs", params=params)).json()
        for run in page["data"]:
            if run["id"] in ids and run.get("startedAt"):
                out[run["id"]] = datetime.fromisoformat(run["startedAt"].replace("Z", "+00:00")).timestamp()
        after = page["pagination"].get("next")
        if not after:
            return out


async def phase(client: httpx.AsyncClient, key: str, n: int, clients: int,
                rate: float | None) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    sent = await trigger_all(str(client.base_url).rstrip("/"), key, n, clients, rate)
    await wait_done(client)
    elapsed = time.perf_counter() - t0
    starts = await started_at(client, set(sent))
    latencies = [(starts[i] - sent[i]) * 1000 for i in sent if i in starts]
    return n / elapsed, latencies


async def bench(args: argparse.Namespace, url: str, key: str) -> float:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60,
                                 limits=httpx.Limits(max_connections=args.clients + 4)) as client:
        await phase(client, key, 200, args.clients, None)  # warm-up: executors, caches, connections
        full_rate, full_lat = await phase(client, key, args.runs, args.clients, None)
        half_rate, half_lat = await phase(client, key, args.runs // 2, args.clients, full_rate / 2)
    print(f"runs: {args.runs}  supervisor concurrency: {args.concurrency}  HTTP clients: {args.clients}")
    print(f"{'load':<10}{'runs/s':>10}{'p50 ms':>10}{'p99 ms':>10}")
    print(f"{'full':<10}{full_rate:>10.0f}{pct(full_lat, 50):>10.1f}{pct(full_lat, 99):>10.1f}")
    print(f"{'half':<10}{half_rate:>10.0f}{pct(half_lat, 50):>10.1f}{pct(half_lat, 99):>10.1f}")
    return full_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--clients", type=int, default=32)
    args = parser.parse_args()
    redis_url = os.environ.get("REDIS_URL", DEFAULT_REDIS)
    prefix = f"rehttp{secrets.token_hex(3)}"
    port = free_port()
    with fresh_database() as database_url:
        env = {**os.environ, "DATABASE_URL": database_url, "REDIS_URL": redis_url, "RUN_ENGINE_KEY_PREFIX": prefix,
               "RUN_ENGINE_SECRET": "bench-secret-not-for-production", "PYTHONPATH": str(ROOT),
               "RUN_ENGINE_LOG_LEVEL": "WARNING", "RUN_ENGINE_ENV_CONCURRENCY": "1000",
               "RUN_ENGINE_API_RATE_LIMIT": "0"}  # a throughput measurement: the per-key request limit off
        cli = [sys.executable, "-m", "run_engine.cli"]
        creds = json.loads(subprocess.run([*cli, "bootstrap", "--org", "bench", "--project", "http"], env=env,
                                          capture_output=True, text=True, check=True).stdout)
        url = f"http://127.0.0.1:{port}"
        procs = [subprocess.Popen([*cli, "server", "--port", str(port)], env=env)]
        try:
            procs.append(subprocess.Popen([*cli, "supervisor", "--token", creds["workerGroupToken"], "--tasks",
                                           "bench.tasks_http", "--api-url", url, "--concurrency",
                                           str(args.concurrency)], env=env, cwd=ROOT))
            wait_healthy(url)
            rate = asyncio.run(bench(args, url, creds["apiKey"]))
        finally:
            for p in reversed(procs):
                p.terminate()
                p.wait(30)
            asyncio.run(delete_prefix(redis_url, prefix))
    print(f"http e2e runs/s: {rate:.0f}")


if __name__ == "__main__":
    main()
