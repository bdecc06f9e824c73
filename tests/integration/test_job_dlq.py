"""The job DLQ can be read, retried, dropped and is bounded by retention (an operator review found it
reachable only with `redis-cli HSCAN`, and kept for ever: a dead job of a kind nothing arms again,
continuing unblocked runs or promoting waiting ones, stayed until someone deleted it by hand). On real
Redis with a fake clock; retention through the leader's duty on a real engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest

from run_engine.clock import FakeClock
from run_engine.jobs import CHANGED, NOT_DEAD, RETRIED, SCHEDULED, UNREADABLE, JobQueue

from .conftest import JOBS_T0

T0 = JOBS_T0
DAY = 86400.0


async def kill(jobs: JobQueue, clock: Any, *specs: tuple[str, str, dict[str, Any], str]) -> None:
    """Schedule these (id, kind, payload, lane) jobs due now and fail each until it is dead (``clock``:
    the queue's, with an ``advance``)."""
    await jobs.apply((), [(i, k, p, clock.now(), lane) for i, k, p, lane in specs])
    for n in range(jobs.max_attempts):
        for job in await jobs.claim(100):
            await jobs.fail(job, f"boom {n + 1}")
        clock.advance(jobs.max_retry_s)


async def walk(jobs: JobQueue, count: int = 100) -> dict[str, Any]:
    out, cursor = {}, 0
    while True:
        cursor, page = await jobs.dead_page(cursor, count)
        out.update({d.id: d for d in page})
        if cursor == 0:
            return out


@pytest.mark.cluster
async def test_a_dead_job_is_listed_with_its_lane_attempts_error_and_time_of_death(
        jobs: JobQueue, clock: FakeClock) -> None:
    await kill(jobs, clock, ("bulk.1", "bulk_action", {"bulk_id": "b1"}, "env_1"), ("hb.r.s", "heartbeat_timeout",
                                                                                     {"run_id": "r"}, ""))
    died = T0 + 2 * jobs.max_retry_s  # the third failure
    dead = await walk(jobs, count=1)
    assert sorted(dead) == ["bulk.1", "hb.r.s"] and await jobs.dead_count() == 2
    d = dead["bulk.1"]
    assert (d.kind, d.lane, d.attempt, d.error, d.payload, d.readable) == (
        "bulk_action", "env_1", 3, "boom 3", {"bulk_id": "b1"}, True)
    assert d.dead_at == pytest.approx(died)
    assert dead["hb.r.s"].lane == ""


@pytest.mark.cluster
async def test_the_job_dlq_is_read_in_bounded_pages(jobs: JobQueue) -> None:
    await jobs.redis.hset(jobs.dlq_key, mapping={  # (values past 64 bytes: a hash table, as a real DLQ)
        f"j{i}": orjson.dumps({"kind": "k", "payload": {"pad": "x" * 80}, "attempt": 12, "token": "t",
                               "error": "down", "dead_at": int(T0 * 1000)}) for i in range(500)})
    cursor, page = await jobs.dead_page(0, 20)
    assert cursor != 0 and 0 < len(page) < 100
    assert len(await walk(jobs, 50)) == 500
    assert len(await jobs.dlq(limit=30)) == 30


@pytest.mark.cluster
async def test_retry_puts_a_dead_job_back_to_run_now_in_its_lane_once(jobs: JobQueue, clock: FakeClock) -> None:
    await kill(jobs, clock, ("d", "k", {"v": 1}, "env_1"), ("other", "k", {}, ""))
    assert await jobs.retry_dead(["d", "nope", "d"]) == [RETRIED, NOT_DEAD, RETRIED]  # (an id given twice: once)
    got = await jobs.get("d")
    assert got is not None and got[1] == pytest.approx(clock.now())
    assert (got[0].attempt, got[0].payload, got[0].lane) == (0, {"v": 1}, "env_1")
    assert sorted(await walk(jobs)) == ["other"]
    [job] = await jobs.claim(10)
    assert (job.id, job.attempt, job.lane) == ("d", 0, "env_1")
    assert await jobs.retry_dead(["d"]) == [NOT_DEAD]  # idempotent: not dead any more
    await jobs.complete(job)
    assert await jobs.retry_dead(["d"]) == [NOT_DEAD]


@pytest.mark.cluster
async def test_retry_of_a_job_scheduled_again_drops_its_dead_copy_and_leaves_the_job(
        jobs: JobQueue, clock: FakeClock) -> None:
    """A process of a version before dead copies left the DLQ on a re-arm wrote the job beside its copy."""
    await jobs.schedule("d", "k", {"v": "live"}, T0 + 60)
    await jobs.redis.hset(jobs.dlq_key, "d", orjson.dumps({"kind": "k", "payload": {"v": "dead"}, "attempt": 3,
                                                           "token": "t", "error": "down"}))
    assert await jobs.retry_dead(["d"]) == [SCHEDULED]
    got = await jobs.get("d")
    assert got is not None and got[0].payload == {"v": "live"} and got[1] == pytest.approx(T0 + 60)
    assert await jobs.dead_count() == 0


@pytest.mark.cluster
async def test_an_entry_that_is_not_a_job_is_not_retried_and_can_be_dropped(jobs: JobQueue, clock: FakeClock) -> None:
    await jobs.redis.hset(jobs.items_key, "bad", b"\xff not json")
    await jobs.redis.zadd(jobs.due_key, {"bad": T0 * 1000})
    assert await jobs.claim(10) == []  # buried by the claim
    await jobs.redis.hset(jobs.dlq_key, "byhand", b"[1, 2]")
    dead = await walk(jobs)
    assert not dead["bad"].readable and "cannot be read" in dead["bad"].error
    assert dead["bad"].dead_at == pytest.approx(T0)
    assert not dead["byhand"].readable and dead["byhand"].dead_at is None
    assert await jobs.retry_dead(["bad", "byhand"]) == [UNREADABLE, UNREADABLE]
    assert await jobs.dead_count() == 2 and await jobs.get("bad") is None
    assert await jobs.drop_dead(["bad", "byhand", "nope"]) == [True, True, False]
    assert await jobs.drop_dead(["bad"]) == [False] and await jobs.dead_count() == 0


@pytest.mark.cluster
async def test_a_dead_entry_is_acted_on_only_while_it_is_the_one_read(jobs: JobQueue, clock: FakeClock) -> None:
    await kill(jobs, clock, ("d", "k", {"v": 1}, ""))
    [read] = (await walk(jobs)).values()
    await jobs.schedule("d", "k", {"v": 2}, clock.now())  # armed again, and dead again, meanwhile
    await kill(jobs, clock)
    assert await jobs.retry_entries([read]) == [CHANGED]
    assert (await walk(jobs))["d"].payload == {"v": 2}  # left as it is now
    assert await jobs.retry_dead(["d"]) == [RETRIED]  # by id: as it is now
    got = await jobs.get("d")
    assert got is not None and got[0].payload == {"v": 2}


async def trim(jobs: JobQueue, older_than: float) -> tuple[int, int]:
    cursor, deleted, stamped = 0, 0, 0
    while True:
        cursor, gone, marked = await jobs.trim_dead(cursor, 10, older_than)
        deleted, stamped = deleted + gone, stamped + marked
        if cursor == 0:
            return deleted, stamped


@pytest.mark.cluster
async def test_trim_deletes_entries_past_the_retention_and_stamps_those_without_a_time(
        jobs: JobQueue, clock: FakeClock) -> None:
    await kill(jobs, clock, ("old", "k", {}, "env_1"))
    clock.advance(8 * DAY)
    await kill(jobs, clock, ("new", "k", {}, ""))
    legacy = orjson.dumps({"kind": "k", "payload": {"big": 12345678901234567}, "attempt": 12, "token": "t",
                           "error": "down"})  # written before entries carried dead_at
    await jobs.redis.hset(jobs.dlq_key, mapping={"legacy": legacy, "garbage": b"\x00 not json"})
    now = clock.now()
    assert await trim(jobs, now - 7 * DAY) == (1, 2)
    dead = await walk(jobs)
    assert sorted(dead) == ["garbage", "legacy", "new"]
    assert dead["legacy"].dead_at == pytest.approx(now) and dead["legacy"].readable
    assert dead["legacy"].payload == {"big": 12345678901234567} and dead["legacy"].error == "down"
    assert dead["garbage"].dead_at == pytest.approx(now) and not dead["garbage"].readable
    assert "not json" in orjson.loads(await jobs.redis.hget(jobs.dlq_key, "garbage"))["item"]
    assert await trim(jobs, now - 7 * DAY) == (0, 0)  # nothing more: the stamps hold
    clock.advance(8 * DAY)
    assert await trim(jobs, clock.now() - 7 * DAY) == (3, 0)
    assert await jobs.dead_count() == 0


async def test_the_leaders_retention_deletes_job_dlq_entries_older_than_the_setting(
        make_engine: Callable[..., Any]) -> None:
    h = await make_engine(job_dlq_retention_days=7)
    q = h.engine.resources.jobs
    now_ms = int(h.clock.now() * 1000)

    def entry(dead_at_ms: int | None) -> bytes:
        data: dict[str, Any] = {"kind": "bulk_action", "payload": {}, "attempt": 12, "token": "t", "error": "down"}
        return orjson.dumps(data if dead_at_ms is None else {**data, "dead_at": dead_at_ms})

    await q.redis.hset(q.dlq_key, mapping={"old": entry(now_ms - int(8 * DAY * 1000)), "new": entry(now_ms - 1000),
                                           "legacy": entry(None)})
    await h.engine.systems.reconciler.retention()
    dead = {d.id: d for d in (await q.dead_page(0, 100))[1]}
    assert sorted(dead) == ["legacy", "new"] and dead["legacy"].dead_at is not None
    h.clock.advance(8 * DAY)
    await h.engine.systems.reconciler.retention()
    assert await q.dead_count() == 0

    kept = await make_engine(job_dlq_retention_days=0)  # 0: kept for ever
    q = kept.engine.resources.jobs
    await q.redis.hset(q.dlq_key, "old", entry(1))
    await kept.engine.systems.reconciler.retention()
    assert await q.dead_count() == 1
