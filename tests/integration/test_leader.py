"""The leader lease across real processes: one leader, failover after the leader is killed, release
on shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
TTL_S, RENEW_S = 3.0, 1.0  # the defaults are 30 / 15: the same code, ten times faster


def _lines(path: Path, word: str) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith(word)] if path.exists() else []


def _until(predicate, what: str, timeout_s: float) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - start


def _holder(database_url: str, name: str) -> str | None:
    with psycopg.connect(database_url) as conn:
        row = conn.execute("SELECT holder FROM engine_lease WHERE name = %s AND expires_at > now()", (name,)).fetchone()
    return row[0] if row else None


def test_one_leader_failover_after_a_kill_and_release_on_shutdown(database_url: str, unique: str,
                                                                  tmp_path: Path) -> None:
    name = f"test-{unique}"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = []
    for log in logs:
        with log.open("wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, str(ROOT / "tests/integration/lease_candidate.py"), database_url, name,
                 str(TTL_S), str(RENEW_S)], stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": str(ROOT)}))
    try:
        _until(lambda: all(_lines(log, "STARTED") for log in logs), "both candidates to start", 60)
        _until(lambda: any(_lines(log, "LEADER") for log in logs), "a leader", 2 * TTL_S)
        time.sleep(2 * RENEW_S)  # a few renewals: still exactly one leader, and only it works
        leaders = [i for i, log in enumerate(logs) if _lines(log, "LEADER")]
        assert len(leaders) == 1, [log.read_text() for log in logs]
        leader, follower = leaders[0], 1 - leaders[0]
        assert _lines(logs[leader], "DUTY") and not _lines(logs[follower], "DUTY")
        holder = _lines(logs[leader], "LEADER")[0].split()[1]
        assert _holder(database_url, name) == holder

        procs[leader].send_signal(signal.SIGKILL)
        procs[leader].wait()
        took = _until(lambda: bool(_lines(logs[follower], "LEADER")), "failover", TTL_S + 5)
        assert took <= TTL_S + 5
        new_holder = _lines(logs[follower], "LEADER")[0].split()[1]
        assert _holder(database_url, name) == new_holder != holder

        procs[follower].send_signal(signal.SIGTERM)
        assert procs[follower].wait(20) == 0
        assert _lines(logs[follower], "STOPPED")
        assert _holder(database_url, name) is None  # released at once, not left to expire
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


async def test_duties_keep_their_own_interval_between_lease_renewals(database_url: str, unique: str) -> None:
    import asyncio

    from run_engine.db.repository import Repository
    from run_engine.leader import LeaderLease

    repo = await Repository.open(database_url, min_size=1, max_size=2)
    lease = LeaderLease(repo, name=f"duty-{unique}", ttl_s=60, renew_s=30)  # renews once in this test
    calls: list[float] = []

    async def duty() -> None:
        calls.append(time.monotonic())

    lease.add_duty("often", 0.1, duty)
    await lease.start()
    try:
        deadline = time.monotonic() + 20
        while len(calls) < 5:  # before the fix a duty ran once per renewal: once in 30 s here
            assert time.monotonic() < deadline, f"the duty ran {len(calls)} times"
            await asyncio.sleep(0.05)
        assert lease.is_leader
    finally:
        await lease.stop()
        await repo.close()
    stopped = len(calls)
    await asyncio.sleep(0.3)
    assert len(calls) == stopped  # stopping the lease stops its duties


def test_a_paused_leader_runs_no_duty_once_its_lease_expired(database_url: str, unique: str, tmp_path: Path) -> None:
    """A leader stopped (SIGSTOP, a long GC, a blocked event loop) past its lease's end, another
    having taken it meanwhile: on resuming it runs no duty before it learns it lost the lease."""
    name = f"paused-{unique}"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = []

    def start(log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:
            return subprocess.Popen(
                [sys.executable, str(ROOT / "tests/integration/lease_candidate.py"), database_url, name,
                 str(TTL_S), str(RENEW_S)], stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": str(ROOT)})

    try:
        procs.append(start(logs[0]))
        _until(lambda: bool(_lines(logs[0], "DUTY")), "the first candidate to lead", 60)
        procs.append(start(logs[1]))
        _until(lambda: bool(_lines(logs[1], "STARTED")), "the second candidate to start", 60)
        procs[0].send_signal(signal.SIGSTOP)
        _until(lambda: Path(f"/proc/{procs[0].pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T",
               "the first candidate to stop", 10)
        duties = len(_lines(logs[0], "DUTY"))
        _until(lambda: bool(_lines(logs[1], "LEADER")), "the second candidate to take over", TTL_S + 10)
        procs[0].send_signal(signal.SIGCONT)
        _until(lambda: bool(_lines(logs[0], "FOLLOWER")), "the first candidate to learn it lost", 20)
        assert len(_lines(logs[0], "DUTY")) == duties, logs[0].read_text()
        assert _lines(logs[1], "DUTY")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()
