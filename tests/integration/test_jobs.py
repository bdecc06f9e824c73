"""Engine jobs on real Redis, with a fake clock."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from run_engine.clock import FakeClock
from run_engine.jobs import Job, JobQueue, JobWorker

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)

T0 = 1_700_000_000.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)


@pytest.fixture
def jobs(redis_client: aioredis.Redis, key_prefix: str, unique: str, clock: FakeClock) -> JobQueue:
    return JobQueue(redis_client, prefix=f"{key_prefix}:j{unique}", clock=clock, max_attempts=3,
                    min_retry_s=1, factor=2)


async def test_schedule_replaces_and_claim_waits_until_due(jobs: JobQueue, clock: FakeClock) -> None:
    await jobs.schedule("a", "kind", {"v": 1}, T0 + 10)
    await jobs.schedule("a", "kind", {"v": 2}, T0 + 20)  # same id: replaced
    assert await jobs.size() == 1
    clock.advance(15)
    assert await jobs.claim(10) == []
    clock.advance(5)
    [job] = await jobs.claim(10)
    assert (job.id, job.payload, job.attempt) == ("a", {"v": 2}, 0)


async def test_reschedule_moves_only_existing_jobs_and_ack_cancels(jobs: JobQueue, clock: FakeClock) -> None:
    await jobs.schedule("hb", "kind", {}, T0 + 1)
    assert await jobs.reschedule_many([("hb", T0 + 60), ("gone", T0 + 60)]) == [True, False]
    assert await jobs.get("gone") is None
    got = await jobs.get("hb")
    assert got is not None and got[1] == pytest.approx(T0 + 60)
    await jobs.ack("hb")
    clock.advance(100)
    assert await jobs.claim(10) == []


async def test_claim_is_atomic_between_concurrent_claimers(jobs: JobQueue, clock: FakeClock) -> None:
    await jobs.apply((), [(f"j{i}", "kind", {}, T0) for i in range(200)])
    batches = await asyncio.gather(*(jobs.claim(7) for _ in range(40)))
    ids = [j.id for batch in batches for j in batch]
    assert len(ids) == len(set(ids)) == 200


async def test_visibility_timeout_redelivers_an_unfinished_job(jobs: JobQueue, clock: FakeClock) -> None:
    await jobs.schedule("v", "kind", {}, T0)
    [first] = await jobs.claim(1, visibility_s=30)
    clock.advance(29)
    assert await jobs.claim(1) == []
    clock.advance(2)
    [again] = await jobs.claim(1)
    assert again.id == first.id


async def test_complete_with_a_stale_token_keeps_the_rescheduled_job(jobs: JobQueue, clock: FakeClock) -> None:
    await jobs.schedule("s", "kind", {"n": 1}, T0)
    [claimed] = await jobs.claim(1)
    await jobs.schedule("s", "kind", {"n": 2}, T0 + 5)  # replaced while its handler ran
    assert await jobs.complete(claimed) is False
    got = await jobs.get("s")
    assert got is not None and got[0].payload == {"n": 2}


async def test_fail_retries_with_growing_delay_then_dead_letters(jobs: JobQueue, clock: FakeClock) -> None:
    await jobs.schedule("f", "kind", {}, T0)
    delays = []
    for _ in range(2):
        [job] = await jobs.claim(1)
        assert await jobs.fail(job, "boom")
        got = await jobs.get("f")
        assert got is not None
        delays.append(got[1] - clock.now())
        clock.set(got[1])
    assert delays == [pytest.approx(1), pytest.approx(2)]
    [job] = await jobs.claim(1)
    assert job.attempt == 2
    await jobs.fail(job, "boom again")
    assert await jobs.get("f") is None
    [(dead, error)] = await jobs.dlq()
    assert dead.id == "f" and error == "boom again"


async def test_worker_runs_handlers_and_settles_them(jobs: JobQueue, clock: FakeClock) -> None:
    seen: list[str] = []

    async def ok(job: Job) -> None:
        seen.append(job.id)

    async def bad(job: Job) -> None:
        raise RuntimeError("nope")

    worker = JobWorker(jobs, {"ok": ok, "bad": bad})
    await jobs.apply((), [("o1", "ok", {}, T0), ("o2", "ok", {}, T0), ("b1", "bad", {}, T0),
                              ("u1", "unknown", {}, T0), ("later", "ok", {}, T0 + 100)])
    assert await worker.run_due_once() == 4
    assert sorted(seen) == ["o1", "o2"]
    assert await jobs.get("o1") is None
    failed = await jobs.get("b1")
    assert failed is not None and failed[0].attempt == 1
    unknown = await jobs.get("u1")
    assert unknown is not None and unknown[0].attempt == 1


async def test_worker_loop_picks_up_due_jobs(jobs: JobQueue, clock: FakeClock) -> None:
    done = asyncio.Event()

    async def handler(job: Job) -> None:
        done.set()

    worker = JobWorker(jobs, {"k": handler}, poll_interval_s=0.01)
    await worker.start()
    try:
        await jobs.schedule("x", "k", {}, T0)
        await asyncio.wait_for(done.wait(), 10)
    finally:
        await worker.stop()
