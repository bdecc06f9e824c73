"""A Redis Cluster failover under load (issue 15): three masters with a replica each; the master
holding the most of the engine's keys is killed while runs are being triggered and executed; its
replica is promoted, the server and its jobs follow the new topology, the reconciler restores what
the promoted replica had not received, and every run is executed exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from run_engine.embedded import EmbeddedRedis, EmbeddedRedisCluster

from .conftest import ROOT, Stack, free_port, start_server, stop

RUNS = 240


@pytest.fixture
def failover_cluster(tmp_path: Path) -> Iterator[EmbeddedRedisCluster]:
    cluster = EmbeddedRedisCluster(tmp_path / "cluster", masters=3, replicas=1, node_timeout_ms=1000)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _busiest_master(cluster: EmbeddedRedisCluster, prefix: str) -> EmbeddedRedis:
    counts: dict[int, int] = {}
    for node in cluster.nodes:
        with redis.Redis(port=node.port) as client:
            if client.info("replication")["role"] == "master":
                counts[node.port] = sum(1 for _ in client.scan_iter(match=f"{prefix}*", count=1000))
    port = max(counts, key=lambda p: counts[p])
    return next(n for n in cluster.nodes if n.port == port)


def _live_masters(cluster: EmbeddedRedisCluster, dead: EmbeddedRedis) -> int:
    count = 0
    for node in cluster.nodes:
        if node is not dead:
            with redis.Redis(port=node.port, socket_timeout=2) as client:
                count += client.info("replication")["role"] == "master"
    return count


def test_a_master_killed_mid_load_loses_no_run_and_runs_none_twice(
        failover_cluster: EmbeddedRedisCluster, empty_database: str, key_prefix: str,
        tmp_path: Path) -> None:
    prefix = f"{key_prefix}:failover"
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": empty_database, "REDIS_URL": failover_cluster.url, "RUN_ENGINE_KEY_PREFIX": prefix,
        "RUN_ENGINE_SECRET": "e2e-secret-not-for-production", "RUN_ENGINE_API_URL": f"http://127.0.0.1:{port}",
        "RUN_ENGINE_EXECUTING_TIMEOUT_S": "5", "RUN_ENGINE_PENDING_EXECUTING_TIMEOUT_S": "3",
        "RUN_ENGINE_RECONCILE_INTERVAL_S": "1", "RUN_ENGINE_RECONCILE_GRACE_S": "2", "RUN_ENGINE_REARM_INTERVAL_S": "5",
        "PYTHONPATH": str(ROOT),
    }
    subprocess.run([sys.executable, "-m", "run_engine.cli", "migrate"], env=env, cwd=ROOT, check=True,
                   capture_output=True, timeout=120)
    boot = subprocess.run([sys.executable, "-m", "run_engine.cli", "bootstrap", "--org", "fo", "--project", "p",
                           "--env", "dev"], env=env, cwd=ROOT, capture_output=True, text=True, check=True, timeout=120)
    creds = json.loads(boot.stdout)
    url, server = start_server(env, tmp_path / "server.log", port=port)
    stack = Stack(url=url, env=env, api_key=creds["apiKey"], token=creds["workerGroupToken"], procs=[server],
                  logs=tmp_path)
    stack.start_supervisor("failover", concurrency=4)
    executions = tmp_path / "executions.log"
    triggered: list[str] = []
    errors: list[str] = []

    def trigger_all() -> None:
        with stack.client() as c:
            for i in range(RUNS):
                body = {"payload": {"log": str(executions)}, "options": {"idempotencyKey": f"fo-{i}"}}
                deadline = time.monotonic() + 60
                while True:  # as a client does: retry a failed trigger with its idempotency key
                    try:
                        r = c.post("/api/v1/tasks/record/trigger", json=body)
                        if r.status_code == 200:
                            triggered.append(r.json()["id"])
                            break
                        errors.append(f"{r.status_code} {r.text[:200]}")
                    except httpx.TransportError as exc:
                        errors.append(repr(exc))
                    if time.monotonic() > deadline:
                        return
                    time.sleep(0.2)
                time.sleep(0.01)

    producer = threading.Thread(target=trigger_all)
    try:
        producer.start()
        deadline = time.monotonic() + 60
        while len(triggered) < RUNS // 3:
            assert time.monotonic() < deadline and producer.is_alive(), errors[-5:]
            time.sleep(0.02)
        victim = _busiest_master(failover_cluster, prefix)
        victim.stop(kill=True)  # mid-load: runs queued, held and executing on it
        promoted = time.monotonic() + 30
        while _live_masters(failover_cluster, victim) < 3:
            assert time.monotonic() < promoted, "the victim's replica was not promoted"
            time.sleep(0.1)
        producer.join(120)
        assert len(triggered) == RUNS, errors[-5:]
        assert len(set(triggered)) == RUNS
        for run_id in triggered:
            run = stack.wait_for(run_id, timeout=120)
            assert run["status"] == "COMPLETED", run
        done = Counter(line.split()[0] for line in executions.read_text().splitlines())
        assert set(done) == set(triggered)
        assert max(done.values()) == 1, [r for r, n in done.items() if n > 1]  # none ran twice
    finally:
        producer.join(5)
        for proc in reversed(stack.procs):
            stop(proc)
