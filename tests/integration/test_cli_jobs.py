"""`run-engine jobs dead|retry|drop` through the real CLI, on the Redis of REDIS_URL under
RUN_ENGINE_KEY_PREFIX (no PostgreSQL needed): before, the job DLQ could only be read with
`redis-cli HSCAN` and acted on by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from run_engine.clock import SystemClock
from run_engine.jobs import JobQueue

from .test_job_dlq import kill


def cli(*args: str, redis_url: str, prefix: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env.update({"REDIS_URL": redis_url, "RUN_ENGINE_KEY_PREFIX": prefix, "COLUMNS": "200"})
    return subprocess.run([sys.executable, "-m", "run_engine.cli", "jobs", *args], env=env, text=True,
                          capture_output=True, timeout=120)


class Clock(SystemClock):
    """The real time, moved on by hand (the failures' back-offs)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def now(self) -> float:
        return super().now() + self.offset

    def advance(self, s: float) -> None:
        self.offset += s


@pytest.fixture
def prefix(key_prefix: str, unique: str) -> str:
    return f"{key_prefix}:cli{unique}"


@pytest.fixture
def jobs(redis_client: aioredis.Redis, prefix: str) -> JobQueue:
    return JobQueue(redis_client, prefix=f"{prefix}:jobs", clock=Clock(), max_attempts=2)


@pytest.mark.cluster
async def test_jobs_dead_lists_retry_puts_back_once_and_drop_deletes(jobs: JobQueue, redis_url: str,
                                                                      prefix: str) -> None:
    jobs.clock.offset = -jobs.max_retry_s * jobs.max_attempts  # type: ignore[attr-defined]
    await kill(jobs, jobs.clock, ("bulk.b1", "bulk_action", {"bulk_id": "b1"}, "env_1"),
               ("promote.d1", "promote_pending", {"deployment_id": "d1"}, ""),
               ("bulk.b2", "bulk_action", {"bulk_id": "b2"}, "env_2"))
    await jobs.redis.hset(jobs.dlq_key, "byhand", b"not json")

    out = cli("dead", "--json", redis_url=redis_url, prefix=prefix)
    assert out.returncode == 0, out
    listed = json.loads(out.stdout)
    assert listed["total"] == 4
    by_id: dict[str, Any] = {d["id"]: d for d in listed["data"]}
    assert sorted(by_id) == ["bulk.b1", "bulk.b2", "byhand", "promote.d1"]
    b1 = by_id["bulk.b1"]
    assert (b1["kind"], b1["lane"], b1["attempts"], b1["error"], b1["payload"], b1["readable"]) == (
        "bulk_action", "env_1", 2, "boom 2", {"bulk_id": "b1"}, True)
    assert b1["deadAt"].endswith("+00:00")
    assert not by_id["byhand"]["readable"] and by_id["byhand"]["deadAt"] is None
    out = cli("dead", "--limit", "1", "--json", redis_url=redis_url, prefix=prefix)
    assert len(json.loads(out.stdout)["data"]) == 1 and json.loads(out.stdout)["total"] == 4
    out = cli("dead", "--kind", "promote_pending", redis_url=redis_url, prefix=prefix)
    assert out.returncode == 0, out
    assert "promote.d1" in out.stdout and "bulk.b1" not in out.stdout
    assert "1 shown of 4 in the job DLQ (kind promote_pending)" in out.stdout

    out = cli("retry", "promote.d1", "nope", "byhand", redis_url=redis_url, prefix=prefix)
    assert out.returncode == 0, out
    assert out.stdout.splitlines() == [
        "promote.d1: retried: due now, its attempts reset",
        "nope: not in the job DLQ (retried or dropped already, or never dead): nothing done",
        "byhand: not retried: its entry is not a job's (see `run-engine jobs dead`); drop it"]
    got = await jobs.get("promote.d1")
    assert got is not None and got[0].attempt == 0 and got[0].payload == {"deployment_id": "d1"}
    out = cli("retry", "promote.d1", "--json", redis_url=redis_url, prefix=prefix)  # twice: once
    assert json.loads(out.stdout)["jobs"] == {"promote.d1": "notDead"}

    out = cli("retry", "--all", "--kind", "bulk_action", "--json", redis_url=redis_url, prefix=prefix)
    assert out.returncode == 0, out
    assert json.loads(out.stdout) == {"retried": 2, "notDead": 0, "scheduled": 0, "unreadable": 0, "changed": 0}
    for job_id, lane in (("bulk.b1", "env_1"), ("bulk.b2", "env_2")):
        got = await jobs.get(job_id)
        assert got is not None and (got[0].attempt, got[0].lane) == (0, lane)
    out = cli("retry", "--all", redis_url=redis_url, prefix=prefix)
    assert out.returncode == 0, out
    assert out.stdout.strip() == "retried 0 dead jobs (1 unreadable)"

    out = cli("drop", "byhand", "nope", redis_url=redis_url, prefix=prefix)
    assert out.returncode == 0, out
    assert out.stdout.splitlines() == ["byhand: dropped", "nope: not in the job DLQ: nothing done"]
    out = cli("dead", redis_url=redis_url, prefix=prefix)
    assert out.returncode == 0 and out.stdout.strip() == "0 shown of 0 in the job DLQ", out


async def test_jobs_retry_refuses_what_it_cannot_mean_and_a_redis_away_is_one_line(
        jobs: JobQueue, redis_url: str, prefix: str) -> None:
    await jobs.redis.hset(jobs.dlq_key, "x", orjson.dumps({"kind": "k", "payload": {}, "attempt": 1, "token": "t"}))
    for args in (["retry"], ["retry", "x", "--all"], ["retry", "x", "--kind", "k"]):
        out = cli(*args, redis_url=redis_url, prefix=prefix)
        assert out.returncode == 2 and out.stderr.strip() == "error: give job ids, or --all [--kind K]", out
    assert await jobs.dead_count() == 1  # nothing done
    out = cli("dead", redis_url="redis://:secret@127.0.0.1:1/0", prefix=prefix)
    assert out.returncode == 1, out
    assert out.stderr.startswith("error: Redis cannot be reached at redis://:***@127.0.0.1:1/0")
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
