"""The leader's housekeeping on real PostgreSQL and Redis: reconciling the queue with PostgreSQL
(after FLUSHALL, a lost dequeue, a lost ack, a lost delay job) and retention."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from run_engine.clock import FakeClock
from run_engine.embedded import EmbeddedRedis
from run_engine.engine import RunEngine, TriggerRequest
from run_engine.settings import EngineSettings
from run_engine.tenancy import ensure_environment

from .conftest import Harness

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


@contextlib.asynccontextmanager
async def private_engine(database_url: str, unique: str, **settings: Any) -> AsyncIterator[Harness]:
    """An engine on its own embedded Redis server, so that FLUSHALL harms nobody else."""
    server = EmbeddedRedis(Path(tempfile.mkdtemp(prefix="re-flush-")))
    url = server.start()
    engine = await RunEngine.create(EngineSettings(database_url=database_url, redis_url=url,
                                                   key_prefix=f"flush{unique}", env_concurrency=200, **settings),
                                    clock=FakeClock(), run_jobs=False)
    env = await ensure_environment(engine.resources.repo, secret="s", org=f"org-flush-{unique}", project="p", env="dev")
    h = Harness(engine, engine.resources.clock, env)  # type: ignore[arg-type]
    await h.deploy({"id": "hello"}, {"id": "limited", "queue": "limited"},
                   queues=[{"name": "limited", "concurrencyLimit": 1}])
    try:
        yield h
    finally:
        await engine.close()
        server.stop()


@pytest.fixture
async def private(database_url: str, unique: str) -> AsyncIterator[Harness]:
    async with private_engine(database_url, unique) as h:
        yield h


async def test_flushall_with_1000_queued_runs_loses_none(private: Harness) -> None:
    h = private
    ids = []
    for _ in range(10):
        ids += [r.id for r in await h.engine.trigger_many(
            [TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=i) for i in range(100)])]
    await h.engine.pause_queue(h.env.env_id, "limited")
    await h.engine.redis.flushall()
    assert await h.engine.dequeue(h.env.worker_group_id, 10) == []
    report = await h.engine.systems.reconciler.reconcile(grace_s=-1, full=True)
    # (the session's database is shared: other tests' queued runs come back into this Redis too)
    assert report.requeued_missing >= 1000 and report.settings_restored >= 1
    assert (await h.engine.resources.queue.queue_stats(h.env.env_id, "limited")).paused  # settings restored
    done: set[str] = set()
    while len(done) < 1000:
        got = await h.engine.dequeue(h.env.worker_group_id, 100)
        assert got, f"only {len(done)} of 1000 came back"
        started = await asyncio.gather(*(h.engine.start_attempt(d.run.id, d.snapshot.id) for d in got))
        await asyncio.gather(*(h.engine.complete_attempt(s.run.id, s.snapshot.id, ok=True) for s in started))
        done |= {d.run.id for d in got}
    assert done == set(ids)
    # nothing of this test's left: a second pass brings none of its runs back (it may requeue other
    # tests' runs, which live processes of the same session change meanwhile)
    await h.engine.systems.reconciler.reconcile(grace_s=-1, full=True)
    assert {(await h.engine.get_run(i)).status for i in ids} == {"COMPLETED"}  # type: ignore[union-attr]
    assert not {d.run.id for d in await h.engine.dequeue(h.env.worker_group_id, 100)} & set(ids)


async def test_a_dequeue_lost_before_postgres_saw_it_is_made_ready_again(private: Harness) -> None:
    h = private
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    # the queue hands the run out, but the process dies before writing PENDING_EXECUTING
    assert [m.run_id for m in await h.engine.resources.queue.dequeue(
        h.env.worker_group_id, 5, h.engine.resources.now_ms())] == [run.id]
    assert await h.engine.dequeue(h.env.worker_group_id, 5) == []
    report = await h.engine.systems.reconciler.reconcile(grace_s=-1, full=True)
    assert report.requeued_stuck == 1
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)
    assert d.run.id == run.id


async def test_a_run_being_handed_out_is_left_to_its_dequeue(private: Harness) -> None:
    """A backlogged run (touched long ago) that a dequeue has just taken from the queue and not yet
    written PENDING_EXECUTING for is not made ready again by a pass in between: a second dequeue
    would only drop it, and free the slot of the run executing meanwhile."""
    h = private
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    async with h.engine.resources.repo.pool.connection() as conn:
        await conn.execute("UPDATE task_run SET updated_at = now() - interval '1 hour' WHERE id = %s", (run.id,))
    assert [m.run_id for m in await h.engine.resources.queue.dequeue(
        h.env.worker_group_id, 5, h.engine.resources.now_ms())] == [run.id]
    report = await h.engine.systems.reconciler.reconcile(grace_s=30, full=True)
    assert report.requeued_stuck == 0
    assert await h.engine.dequeue(h.env.worker_group_id, 5) == []
    h.clock.advance(31)  # held longer than the grace: its dequeue died before writing the snapshot
    report = await h.engine.systems.reconciler.reconcile(grace_s=30, full=True)
    assert report.requeued_stuck == 1
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)
    assert d.run.id == run.id


async def finished_holding_a_slot(h: Harness) -> tuple[str, Any]:
    """A run of ``limited`` that finished and still holds its slot in the queue (as before its ack,
    or when the ack was lost): its id and its queue item."""
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="limited"))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)
    s = await h.engine.start_attempt(run.id, d.snapshot.id)
    await h.engine.complete_attempt(run.id, s.snapshot.id, ok=True)
    q = h.engine.resources.queue
    item = h.engine.systems.enqueue.item_for(await h.engine.get_run(run.id))  # type: ignore[arg-type]
    await q.enqueue([item], h.engine.resources.now_ms())
    await q.dequeue(h.env.worker_group_id, 5, h.engine.resources.now_ms())
    assert run.id in await q.running_ids(h.env.env_id)
    return run.id, item


async def test_a_slot_held_by_a_finished_run_is_freed(private: Harness) -> None:
    h = private
    run_id, _ = await finished_holding_a_slot(h)  # the ack was lost
    assert await h.engine.resources.queue.running_ids(h.env.env_id) == {run_id}
    nxt = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="limited"))
    assert await h.engine.dequeue(h.env.worker_group_id, 5) == []  # limit 1, taken by the ghost
    assert (await h.engine.systems.reconciler.reconcile(grace_s=-1, full=True)).slots_freed == 1
    (d2,) = await h.engine.dequeue(h.env.worker_group_id, 5)
    assert d2.run.id == nxt.id


async def test_the_slot_pass_leaves_a_message_enqueued_again_after_it_looked(
        private: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the pass's read of the slots and its ack, the run was enqueued again (a suspended
    run continued): its slot is given back already, and its new message must stay."""
    h = private
    run_id, item = await finished_holding_a_slot(h)  # a slot PostgreSQL does not know
    q = h.engine.resources.queue
    runs = h.engine.resources.repo.runs
    real = runs.slot_holders

    async def then_enqueued_again(ids: Any) -> Any:
        seen = await real(ids)
        await q.enqueue([item], h.engine.resources.now_ms())
        return seen

    monkeypatch.setattr(runs, "slot_holders", then_enqueued_again)
    await h.engine.systems.reconciler.reconcile(grace_s=-1, full=True)
    assert await q.message_states([(h.env.env_id, run_id)]) == ["ready"]


async def test_the_slot_pass_reads_only_environments_that_hold_slots(
        private: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """It asked Redis for the slots of every environment, one round trip each, every pass."""
    h = private
    idle = [await ensure_environment(h.engine.resources.repo, secret="s", org=f"{h.env.env_id}-idle", project="p",
                                     env=f"e{i}") for i in range(5)]
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    await h.engine.dequeue(h.env.worker_group_id, 5)
    looked: list[str] = []
    q = h.engine.resources.queue
    real = q.running_ids

    async def spy(env_id: str) -> set[str]:
        looked.append(env_id)
        return await real(env_id)

    monkeypatch.setattr(q, "running_ids", spy)
    await h.engine.systems.reconciler.reconcile(grace_s=-1, full=True)
    assert h.env.env_id in looked and not {e.env_id for e in idle} & set(looked)
    assert run.id in await real(h.env.env_id)  # its slot, held by a run PostgreSQL shows dequeued, stays


async def test_a_delayed_run_whose_job_was_lost_is_enqueued(private: Harness) -> None:
    h = private
    when = datetime.fromtimestamp(h.engine.resources.clock.now() + 5, UTC)
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", delay_until=when))
    await h.engine.redis.flushall()
    h.clock.advance(6)
    await h.engine.run_due_jobs()
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "DELAYED"  # the job is gone
    report = await h.engine.systems.reconciler.reconcile(grace_s=-60)
    assert report.delayed_enqueued >= 1  # (other tests' delayed runs in this database count too)
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)
    assert d.run.id == run.id


async def test_a_pending_version_run_the_registration_missed_is_enqueued(
        private: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run created from a server's stale "no deployment" cache while the deployment registered
    elsewhere: the registration's promotion did not see it; the reconciler enqueues it."""
    h = private
    missed = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="later", payload=1))
    never = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="undeployed", payload=2))
    assert missed.status == never.status == "PENDING_VERSION"
    repo = h.engine.resources.repo.runs

    async def nothing_waits(*args: object, **kwargs: object) -> list[str]:
        return []

    monkeypatch.setattr(repo, "pending_version_runs", nothing_waits)  # the registration's read ran first
    await h.deploy({"id": "hello"}, {"id": "limited", "queue": "limited"}, {"id": "later", "queue": "later-q"},
                   queues=[{"name": "limited", "concurrencyLimit": 1}], version="2")
    monkeypatch.undo()
    assert await h.engine.dequeue(h.env.worker_group_id, 5) == []
    report = await h.engine.systems.reconciler.reconcile(grace_s=-60)
    assert report.pending_version_enqueued >= 1  # (other tests' runs in this database may count too)
    assert (await h.engine.latest_snapshot(never.id)).engine_status == "PENDING_VERSION"  # no deployment has it
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)
    assert d.run.id == missed.id and d.run.queue == "later-q"
    assert await h.statuses(missed.id) == ["PENDING_VERSION", "QUEUED", "PENDING_EXECUTING"]
    assert (await h.engine.systems.reconciler.reconcile(grace_s=-60)).pending_version_enqueued == 0


async def test_retention_deletes_old_finished_runs_with_their_history(make_engine) -> None:  # type: ignore[no-untyped-def]
    h = await make_engine(retention_days=1e-9, retention_batch=500)  # everything finished is "old"
    await h.deploy({"id": "hello"})
    finished = []
    for _ in range(5):
        run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
        (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)
        s = await h.engine.start_attempt(run.id, d.snapshot.id)
        await h.engine.complete_attempt(run.id, s.snapshot.id, ok=True)
        finished.append(run.id)
    alive = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    await asyncio.sleep(0.01)
    assert await h.engine.systems.reconciler.retention() >= 5
    for run_id in finished:
        assert await h.engine.get_run(run_id) is None
        assert await h.engine.snapshots(run_id) == []
    assert await h.engine.get_run(alive.id) is not None


async def test_retention_keeps_the_finished_children_of_a_batch_still_waited_on(make_engine) -> None:  # type: ignore[no-untyped-def]
    """Deleted, they made the batch look short of runs, and the sweeper failed the parent's wait
    while a child still ran."""
    h = await make_engine(retention_days=1e-9, retention_batch=500)
    await h.deploy({"id": "hello"})
    parent = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)
    s = await h.engine.start_attempt(parent.id, d.snapshot.id)
    ids, out = await h.engine.trigger_and_wait(parent.id, s.snapshot.id, 0, [
        TriggerRequest(env_id=h.env.env_id, task_id="hello") for _ in range(2)], batch=True)
    got = {x.run.id: x for x in await h.engine.dequeue(h.env.worker_group_id, 5)}
    st = await h.engine.start_attempt(ids[0], got[ids[0]].snapshot.id)
    await h.engine.complete_attempt(ids[0], st.snapshot.id, ok=True)  # the other child still runs
    await asyncio.sleep(0.01)
    await h.engine.systems.reconciler.retention()
    assert await h.engine.get_run(ids[0]) is not None
    await h.engine.waitpoints.sweep(grace_s=0)
    assert (await h.engine.latest_snapshot(parent.id)).engine_status == "EXECUTING_WITH_WAITPOINTS"


async def test_the_jobs_a_version_before_lanes_armed_move_to_their_environments_lanes(private: Harness) -> None:
    """A delay, a TTL and a token's timeout armed before the upgrade sat in the default lane (the
    sorted set every version claims) until they fired: a tenant's million delays for tomorrow would
    come due there, ahead of every held run's check. The re-arm moves them into their lanes."""
    import orjson

    h = private
    engine, jobs = h.engine, h.engine.resources.jobs
    token, _ = await engine.waitpoints.create_token(h.env.env_id, timeout_s=600)
    delayed = await engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", ttl_s=300,
                                                  delay_until=datetime.fromtimestamp(h.clock.now() + 60, UTC)))
    moved = [f"delay.{delayed.id}", f"ttl.{delayed.id}", f"wpto.{token.id}"]
    await jobs.apply(moved, ())
    for job_id in moved:  # as the version before lanes wrote them
        await engine.redis.zadd(jobs.due_key, {job_id: int((h.clock.now() + 60) * 1000)})
        await engine.redis.hset(jobs.items_key, job_id, orjson.dumps(
            {"kind": "k", "payload": {}, "attempt": 0, "token": "old"}))
    lane = h.env.env_id
    assert await jobs.misplaced([(j, lane) for j in moved]) == moved
    assert await engine.systems.reconciler.rearm_jobs(grace_s=0, full=True) >= 3
    assert await jobs.misplaced([(j, lane) for j in moved]) == []
    assert {await engine.redis.zscore(jobs.due_key, j) for j in moved} == {None}


async def test_lost_engine_jobs_are_rearmed_and_fire(private: Harness) -> None:
    """Issue 11: after a flush a token's timeout, an executing run's heartbeat timeout and max
    duration, a delayed run's date, a TTL and the waitpoint sweeper were gone for good."""
    h = private
    await h.deploy({"id": "hello"}, {"id": "bounded", "maxDuration": 30}, version="2")
    engine, jobs = h.engine, h.engine.resources.jobs
    executing = await engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="bounded"))
    (d,) = await engine.dequeue(h.env.worker_group_id, 1)
    started = await engine.start_attempt(executing.id, d.snapshot.id)
    token, _ = await engine.waitpoints.create_token(h.env.env_id, timeout_s=4)
    delayed = await engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", ttl_s=300,
                                                  delay_until=datetime.fromtimestamp(h.clock.now() + 60, UTC)))
    expected = [f"hb.{executing.id}.{started.snapshot.id}", f"maxdur.{executing.id}.1", f"wpto.{token.id}",
                f"delay.{delayed.id}", f"ttl.{delayed.id}", "sweep.waitpoints"]
    await engine._schedule_sweep()
    assert await jobs.missing(expected) == []
    await engine.redis.flushall()
    assert await jobs.missing(expected) == expected

    report = await engine.systems.reconciler.reconcile(grace_s=0)  # the epoch is gone: re-arm everything
    assert report.jobs_rearmed >= len(expected)
    assert await jobs.missing(expected) == []
    assert await engine.systems.reconciler.rearm_jobs(grace_s=0, full=True) == 0  # idempotent

    await h.advance(5)  # the token's timeout fires
    got = await engine.resources.repo.waitpoints.get(token.id)
    assert got is not None and got.status == "COMPLETED" and got.output_is_error
    await h.advance(61)  # the executing run's worker is gone: the heartbeat timeout fires; the delay is due
    statuses = await h.statuses(executing.id)
    assert statuses[-1] != "EXECUTING", statuses
    assert (await engine.get_run(delayed.id)).status == "QUEUED"  # type: ignore[union-attr]


async def test_engine_jobs_lost_alone_are_rearmed_whole(h: Harness) -> None:
    """On a Redis Cluster the engine jobs live on another master than the run queue: the master
    holding them restarting empty must be seen (the queue's epoch is still there) and every job
    re-armed in the next pass, not left to the budgeted scans."""
    engine, jobs = h.engine, h.engine.resources.jobs
    reconciler = engine.systems.reconciler
    job = await executing_run_heartbeat_job(h)  # both epochs marked first
    assert await jobs.missing([job]) == []
    await engine.redis.delete(*[k async for k in engine.redis.scan_iter(f"{jobs.base}*")])  # only the jobs' slot lost
    assert await engine.resources.queue.has_epoch()
    report = await reconciler.reconcile(grace_s=0)
    assert report.jobs_rearmed >= 1 and report.settings_restored == 0
    assert await jobs.missing([job]) == [] and await jobs.has_epoch()


async def test_an_epoch_key_that_holds_no_epoch_is_taken_as_lost(
        h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    """An epoch key whose value is not an epoch (corrupted, written by hand: `recheck:abc`) made
    reading it raise ValueError, and with it every reconcile pass: nothing was reconciled again,
    and a loss of the data beside it was never repaired. It is now taken as the key's absence
    (logged): the data is restored from PostgreSQL and the key written again."""
    engine, jobs, q = h.engine, h.engine.resources.jobs, h.engine.resources.queue
    reconciler = engine.systems.reconciler
    job = await executing_run_heartbeat_job(h)  # both epochs marked first
    await engine.redis.delete(*[k async for k in engine.redis.scan_iter(f"{jobs.base}*")])  # the jobs' data lost
    await engine.redis.set(jobs.epoch_key, "recheck:abc")  # and its epoch key spoilt
    report = await reconciler.reconcile(grace_s=0)
    assert report.jobs_rearmed >= 1 and report.settings_restored == 0
    assert await jobs.missing([job]) == [] and await jobs.epoch() == 0.0  # written again, whole
    assert "recheck:abc" in caplog.text
    await engine.redis.set(q._epochs()[-1], b"\xff")  # a queue's epoch key too (not even text)
    report = await reconciler.reconcile(grace_s=0)
    assert report.settings_restored >= 1
    assert await q.epoch() == 0.0


async def test_a_full_pass_after_redis_lost_its_data_is_done_again_until_it_succeeds(
        private: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The epoch was marked before the full pass: one that failed or was cut short (the leader
    restarting) left the rest of the lost runs to the budgeted scans (hours for a million)."""
    h = private
    engine, reconciler = h.engine, h.engine.systems.reconciler
    runs = await engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=i)
                                      for i in range(3)])
    await engine.redis.flushall()
    real = reconciler._queued_runs

    async def cut_short(*args: object, **kwargs: object) -> None:
        raise ConnectionError("the leader lost its connection part-way")

    monkeypatch.setattr(reconciler, "_queued_runs", cut_short)
    await reconciler.reconcile(grace_s=0)
    assert not await engine.resources.queue.has_epoch()  # not marked: the next pass is full again
    monkeypatch.setattr(reconciler, "_queued_runs", real)
    monkeypatch.setattr(reconciler, "_slots", cut_short)  # another step failing does not make every pass full
    report = await reconciler.reconcile(grace_s=0)
    assert report.requeued_missing >= 3 and report.settings_restored >= 1  # (other tests' runs too: one database)
    assert await engine.resources.queue.has_epoch()
    got = await engine.dequeue(h.env.worker_group_id, 5)
    assert sorted(x.run.id for x in got) == sorted(r.id for r in runs)


async def test_runs_touched_just_before_redis_lost_its_data_are_restored_once_past_the_grace(
        database_url: str, unique: str) -> None:
    """The leader's passes keep the grace, so the full pass after a loss skipped the runs touched
    within it before the loss (a queued run's message, an executing run's heartbeat job) and
    marked the epoch: they waited for the budgeted scans to come round (tens of minutes for a
    large backlog). The first pass a grace after that one reads everything again."""
    async with private_engine(database_url, unique, reconcile_budget=1) as h:
        engine, q, jobs = h.engine, h.engine.resources.queue, h.engine.resources.jobs
        reconciler = engine.systems.reconciler
        grace, interval = engine.resources.settings.reconcile_grace_s, engine.resources.settings.reconcile_interval_s
        await reconciler.reconcile(grace_s=-1)  # a running system: both epochs marked
        executing = await engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
        (d,) = await engine.dequeue(h.env.worker_group_id, 1, environments=[h.env.env_id], start=True)
        assert d.run.id == executing.id and d.started is not None
        heartbeat = f"hb.{executing.id}.{d.started.snapshot.id}"
        # a backlog queued long ago, and the run of largest id triggered just before the loss:
        # a budgeted pass (one row) reads a backlog run (or another test's) first, never it
        *backlog, recent = sorted(r.id for r in await engine.trigger_many(
            [TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=i) for i in range(5)]))

        async def age(ids: list[str], seconds: float) -> None:  # PostgreSQL's clock cannot be faked
            async with engine.resources.repo.pool.connection() as conn:
                await conn.execute("UPDATE task_run SET updated_at = updated_at - make_interval(secs => %s)"
                                   " WHERE id = ANY(%s)", (seconds, ids))

        await age(backlog, 3600)
        await engine.redis.flushall()
        report = await reconciler.reconcile()  # as the leader's duty calls it: with the grace
        assert report.settings_restored >= 1 and report.requeued_missing >= len(backlog)
        # within the grace: left to a writer that may still be in flight
        assert await q.placements([(h.env.env_id, recent)]) == [None]
        assert await jobs.missing([heartbeat]) == [heartbeat]
        for _ in range(int(grace // interval)):  # the leader's next passes, the time passing on both clocks
            h.clock.advance(interval)
            await age([recent, executing.id], interval)
            report = await reconciler.reconcile()
            assert report.settings_restored == 0  # not the loss's pass again
        assert await q.placements([(h.env.env_id, recent)]) == ["ready"]
        assert await jobs.missing([heartbeat]) == []


async def test_a_heartbeat_rearms_a_lost_timeout_job(h: Harness) -> None:
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1)
    started = await h.engine.start_attempt(run.id, d.snapshot.id)
    job = f"hb.{run.id}.{started.snapshot.id}"
    await h.engine.resources.jobs.ack(job)  # as if lost
    assert await h.engine.resources.jobs.missing([job]) == [job]
    await h.engine.heartbeat(run.id, started.snapshot.id)
    assert await h.engine.resources.jobs.missing([job]) == []


async def test_a_dequeue_whose_jobs_update_fails_after_its_commit_still_hands_the_runs_out(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis fails between the dequeue's commit and its jobs (a master lost in a failover): the
    worker gets its runs all the same, and their heartbeat arms the timeout that was not."""
    runs = [await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=i)) for i in range(2)]

    async def redis_down(*args: object, **kwargs: object) -> None:
        raise ConnectionError("Redis is down")

    monkeypatch.setattr(h.engine.resources, "change_jobs", redis_down)
    got = await h.engine.dequeue(h.env.worker_group_id, 5, start=True)
    monkeypatch.undo()
    assert sorted(d.run.id for d in got) == sorted(r.id for r in runs)
    for d in got:
        assert d.started is not None
        job = f"hb.{d.run.id}.{d.started.snapshot.id}"
        assert await h.engine.resources.jobs.missing([job]) == [job]  # the update was lost
        await h.engine.heartbeat(d.run.id, d.started.snapshot.id)
        assert await h.engine.resources.jobs.missing([job]) == []
        await h.engine.complete_attempt(d.run.id, d.started.snapshot.id, ok=True, output=1)
        assert (await h.engine.get_run(d.run.id)).status == "COMPLETED"


async def test_a_pass_reads_its_budget_and_the_next_goes_on_where_it_stopped(make_engine) -> None:  # type: ignore[no-untyped-def]
    """The scan is incremental: a pass costs the same whatever the backlog, and passes in turn
    cover every QUEUED run (the database is shared: other tests' runs are in the scan too)."""
    h = await make_engine(reconcile_budget=10)
    await h.deploy({"id": "hello"})
    reconciler = h.engine.systems.reconciler
    await reconciler.reconcile(grace_s=-1)  # Redis had no epoch: a full pass, which marks it
    runs = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=i)
                                        for i in range(25)])
    queue = h.engine.resources.queue
    await queue.remove_many([(h.env.env_id, r.id) for r in runs])  # lost from Redis
    missing = sorted(r.id for r in runs)
    passes = 0
    deadline = time.monotonic() + 120
    while missing:
        report = await reconciler.reconcile(grace_s=-1)
        assert report.scanned <= 10
        passes += 1
        placed = await queue.placements([(h.env.env_id, rid) for rid in missing])
        missing = [rid for rid, where in zip(missing, placed, strict=True) if where is None]
        assert time.monotonic() < deadline, f"{len(missing)} still missing after {passes} passes"
    assert passes >= 3  # 25 runs, at most 10 read a pass
    got = await h.engine.dequeue(h.env.worker_group_id, 100)
    assert {r.id for r in runs} <= {d.run.id for d in got}


async def test_a_slot_is_freed_only_when_two_passes_saw_it_held_by_a_finished_run(private: Harness) -> None:
    """A run's FINISHED snapshot commits a moment before its ack frees its slot: a pass that looks
    in between must not count it as repaired (nor race the ack); a slot whose ack was really lost
    is freed by the next pass."""
    h = private
    q = h.engine.resources.queue
    reconciler = h.engine.systems.reconciler

    acked, _ = await finished_holding_a_slot(h)
    assert (await reconciler.reconcile(grace_s=30)).slots_freed == 0  # seen once: perhaps its ack is on its way
    await q.ack([(h.env.env_id, acked)])  # ... and it was
    lost, _ = await finished_holding_a_slot(h)
    assert (await reconciler.reconcile(grace_s=30)).slots_freed == 0  # the new one seen once
    assert (await reconciler.reconcile(grace_s=30)).slots_freed == 1  # seen twice, same snapshot: freed
    assert lost not in await q.running_ids(h.env.env_id)


def is_dequeue(transitions: Any, *args: Any, **kwargs: Any) -> bool:
    """Whether a call of ``append_many`` is a dequeue's write (to PENDING_EXECUTING): the
    reconciler's own transitions go through the same system, and must not be taken for one (a
    pass that moved a run while a dequeue was held stalled there for good)."""
    return any(t.engine_status == "PENDING_EXECUTING" for t in transitions)


@contextlib.asynccontextmanager
async def stalled_dequeue(h: Harness) -> AsyncIterator[tuple[asyncio.Event, asyncio.Event]]:
    """The next dequeue stalls before its PostgreSQL write: ``stalled`` is set when it does, and it
    goes on once ``go`` is set (at the latest when the block ends)."""
    dequeue = h.engine.systems.dequeue
    real = dequeue.execution_snapshot.append_many
    stalled, go = asyncio.Event(), asyncio.Event()

    async def append_many(*args: Any, **kwargs: Any) -> Any:
        if is_dequeue(*args, **kwargs) and not stalled.is_set():
            stalled.set()
            await go.wait()
        return await real(*args, **kwargs)

    dequeue.execution_snapshot.append_many = append_many  # type: ignore[method-assign]
    try:
        yield stalled, go
    finally:
        go.set()
        dequeue.execution_snapshot.append_many = real  # type: ignore[method-assign]


async def test_a_dequeue_that_resumes_after_the_run_was_handed_out_again_frees_no_slot_of_it(
        private: Harness) -> None:
    """A dequeue stalled between its take from the queue and its PostgreSQL write (a GC, a
    SIGSTOP, a connection wait) longer than the grace: the reconciler makes the run ready again
    and another dequeue hands it out. The stalled one then finds the run moved on and drops its
    message; it must drop only its own delivery's. Before, it acked the run wherever its message
    was, deleting the second dequeue's and freeing the slot of a run a worker holds (one run over
    every limit, and the reconciler later read it as a run holding no slot)."""
    h = private
    async with stalled_dequeue(h) as (stalled, go):
        run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="limited"))
        first = asyncio.create_task(h.engine.dequeue(h.env.worker_group_id, 5))
        await asyncio.wait_for(stalled.wait(), 10)
        h.clock.advance(31)  # held longer than the grace
        report = await h.engine.systems.reconciler.reconcile(grace_s=-1, full=True)
        assert report.requeued_stuck >= 1
        (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)
        assert d.run.id == run.id
        go.set()
        assert await asyncio.wait_for(first, 10) == []  # its compare-and-set failed: nothing handed out
    assert run.id in await h.engine.resources.queue.running_ids(h.env.env_id)  # the second's slot, kept
    other = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="limited"))
    assert await h.engine.dequeue(h.env.worker_group_id, 5) == []  # `limited` allows one at a time
    s = await h.engine.start_attempt(run.id, d.snapshot.id)
    await h.engine.complete_attempt(run.id, s.snapshot.id, ok=True)
    assert run.id not in await h.engine.resources.queue.running_ids(h.env.env_id)
    assert [x.run.id for x in await h.engine.dequeue(h.env.worker_group_id, 5)] == [other.id]


async def test_a_stalled_dequeue_frees_no_slot_of_a_later_delivery_with_the_same_count(private: Harness) -> None:
    """As above, but the run went round once more before the stalled dequeue resumed: its attempt
    failed and its retry was enqueued again with its delivery count reset (as a retry, a
    continuation and a redrive do), and a third dequeue took it as its first delivery again, the
    count the stalled dequeue saw. The stalled one must still not take that delivery for its own:
    before, its ack '=1' matched, deleted the third dequeue's held message and freed the slot of a
    run a worker was starting (the queue's limit of 1 then let a second run out beside it)."""
    h = private
    async with stalled_dequeue(h) as (stalled, go):
        run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="limited", max_attempts=3))
        first = asyncio.create_task(h.engine.dequeue(h.env.worker_group_id, 5))
        await asyncio.wait_for(stalled.wait(), 10)
        h.clock.advance(31)  # held longer than the grace
        assert (await h.engine.systems.reconciler.reconcile(grace_s=-1, full=True)).requeued_stuck >= 1
        (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)
        assert d.run.id == run.id and d.deliveries == 2
        s = await h.engine.start_attempt(run.id, d.snapshot.id)
        await h.engine.complete_attempt(run.id, s.snapshot.id, ok=False,
                                        error={"type": "BUILT_IN_ERROR", "message": "boom"}, retryable=True)
        third: list[Any] = []
        deadline = time.monotonic() + 10
        while not third and time.monotonic() < deadline:  # the retry's back-off
            h.clock.advance(5)
            third = await h.engine.dequeue(h.env.worker_group_id, 5)
        assert [x.run.id for x in third] == [run.id] and third[0].deliveries == 1
        go.set()
        assert await asyncio.wait_for(first, 10) == []  # its compare-and-set failed: nothing handed out
    assert run.id in await h.engine.resources.queue.running_ids(h.env.env_id)  # the third's slot, kept
    await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="limited"))
    assert await h.engine.dequeue(h.env.worker_group_id, 5) == []  # `limited` allows one at a time


async def test_a_stalled_dequeue_whose_run_was_made_ready_again_and_not_taken_keeps_its_slot(
        private: Harness) -> None:
    """A dequeue stalled between its take and its PostgreSQL write past the grace: the reconciler
    makes the run ready again (its slot freed), and no other dequeue takes it before the stalled
    one resumes. Its compare-and-set then succeeds (PostgreSQL still had the run QUEUED) and the
    run is handed out, once. Before, it ran with no slot and its message left ready: the next
    dequeue took that message, dropped it (its compare-and-set failed) and the queue's limit of 1
    let a second run out beside it, for as long as the first ran; nothing in the reconciler sees
    a run that holds no slot. Now the resumed dequeue takes its delivery back: held, its slot
    counted once."""
    h = private
    q = h.engine.resources.queue
    async with stalled_dequeue(h) as (stalled, go):
        run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="limited"))
        first = asyncio.create_task(h.engine.dequeue(h.env.worker_group_id, 5))
        await asyncio.wait_for(stalled.wait(), 10)
        h.clock.advance(31)  # held longer than the grace
        assert (await h.engine.systems.reconciler.reconcile(grace_s=-1, full=True)).requeued_stuck >= 1
        go.set()
        (d,) = await asyncio.wait_for(first, 10)  # its compare-and-set succeeded: handed out
    assert d.run.id == run.id
    assert run.id in await q.running_ids(h.env.env_id)  # taken back at once: held, its slot counted
    assert (await q.queue_stats(h.env.env_id, "limited")).queued == 0
    other = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="limited"))
    for _ in range(3):  # neither the run a second time nor a second run of `limited` beside it
        assert await h.engine.dequeue(h.env.worker_group_id, 5) == []
    assert run.id in await q.running_ids(h.env.env_id)
    report = await h.engine.systems.reconciler.reconcile(grace_s=-1, full=True)
    assert (report.requeued_stuck, report.slots_freed) == (0, 0)
    assert run.id in await q.running_ids(h.env.env_id)
    s = await h.engine.start_attempt(run.id, d.snapshot.id)
    await h.engine.complete_attempt(run.id, s.snapshot.id, ok=True)
    assert run.id not in await q.running_ids(h.env.env_id)
    assert [x.run.id for x in await h.engine.dequeue(h.env.worker_group_id, 5)] == [other.id]


async def test_a_stalled_dequeue_that_writes_its_run_while_the_reconciler_makes_it_ready_keeps_its_slot(
        private: Harness) -> None:
    """As above, but the stalled dequeue resumes inside the reconciler's repair: after the pass
    read the run QUEUED and before it made the run ready again. The dequeue writes the run and
    finds its delivery still held (nothing to take back); the pass then frees its slot. The pass
    reads the run once more after its move and takes the delivery back itself."""
    h = private
    q = h.engine.resources.queue
    resources = h.engine.resources
    real = resources.enqueue_items
    handed: list[Any] = []
    async with stalled_dequeue(h) as (stalled, go):
        run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="limited"))
        first = asyncio.create_task(h.engine.dequeue(h.env.worker_group_id, 5))
        await asyncio.wait_for(stalled.wait(), 10)
        h.clock.advance(31)  # held longer than the grace

        async def enqueue_items(items: Any) -> Any:
            if any(i.run_id == run.id for i in items) and not go.is_set():
                go.set()  # the pass read the run QUEUED: the dequeue resumes and writes it first
                handed.extend(await asyncio.wait_for(first, 10))
            return await real(items)

        resources.enqueue_items = enqueue_items  # type: ignore[method-assign]
        try:
            await h.engine.systems.reconciler.reconcile(grace_s=-1, full=True)
        finally:
            resources.enqueue_items = real  # type: ignore[method-assign]
    (d,) = handed
    assert d.run.id == run.id
    assert run.id in await q.running_ids(h.env.env_id)
    assert (await q.queue_stats(h.env.env_id, "limited")).queued == 0
    other = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="limited"))
    for _ in range(3):
        assert await h.engine.dequeue(h.env.worker_group_id, 5) == []
    s = await h.engine.start_attempt(run.id, d.snapshot.id)
    await h.engine.complete_attempt(run.id, s.snapshot.id, ok=True)
    assert [x.run.id for x in await h.engine.dequeue(h.env.worker_group_id, 5)] == [other.id]


async def test_a_dequeue_that_loses_its_run_to_a_stalled_one_keeps_the_slot_for_it(private: Harness) -> None:
    """As above, but a second dequeue took the run made ready again, and the stalled one resumed
    and won the compare-and-set before the second wrote: the second finds the run moved on to
    PENDING_EXECUTING, a state that holds a slot. Before, it dropped its delivery (the message and
    the slot) while the first dequeue's worker ran the run: the queue's limit of 1 let a second run
    out beside it. Now a dequeue whose run moved on to a state that holds a slot leaves its
    message held: the run's slot, freed by the run's own ack."""
    h = private
    dequeue = h.engine.systems.dequeue
    real = dequeue.execution_snapshot.append_many
    stalled = [asyncio.Event(), asyncio.Event()]  # the first and the second dequeue, before they write
    gates = [asyncio.Event(), asyncio.Event()]

    async def append_many(*args: Any, **kwargs: Any) -> Any:
        n = next((i for i, e in enumerate(stalled) if not e.is_set()), None) if is_dequeue(*args, **kwargs) else None
        if n is not None:
            stalled[n].set()
            await gates[n].wait()
        return await real(*args, **kwargs)

    dequeue.execution_snapshot.append_many = append_many  # type: ignore[method-assign]
    try:
        run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="limited"))
        first = asyncio.create_task(h.engine.dequeue(h.env.worker_group_id, 5))
        await asyncio.wait_for(stalled[0].wait(), 10)
        h.clock.advance(31)  # held longer than the grace
        reconciled = await asyncio.wait_for(h.engine.systems.reconciler.reconcile(grace_s=-1, full=True), 30)
        assert reconciled.requeued_stuck >= 1
        second = asyncio.create_task(h.engine.dequeue(h.env.worker_group_id, 5))
        await asyncio.wait_for(stalled[1].wait(), 10)  # the second took the run, and stalls too
        gates[0].set()
        (d,) = await asyncio.wait_for(first, 10)  # the first wins
        gates[1].set()
        assert await asyncio.wait_for(second, 10) == []  # the second's compare-and-set failed
    finally:
        for g in gates:
            g.set()
        dequeue.execution_snapshot.append_many = real  # type: ignore[method-assign]
    assert d.run.id == run.id
    q = h.engine.resources.queue
    assert run.id in await q.running_ids(h.env.env_id)
    other = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="limited"))
    for _ in range(3):
        assert await h.engine.dequeue(h.env.worker_group_id, 5) == []
    s = await h.engine.start_attempt(run.id, d.snapshot.id)
    await h.engine.complete_attempt(run.id, s.snapshot.id, ok=True)
    assert run.id not in await q.running_ids(h.env.env_id)
    assert [x.run.id for x in await h.engine.dequeue(h.env.worker_group_id, 5)] == [other.id]


class _RunsData(Exception):
    sqlstate = "22000"  # data exception: the statement's runs are split


async def test_a_dequeue_that_stalls_in_its_split_and_starts_a_run_made_ready_again_keeps_its_slot(
        private: Harness) -> None:
    """A dequeue that starts its runs (what the supervisor asks) splits a batch whose statement
    failed on a run's data; it stalls between its halves past the grace, and the reconciler makes
    the second half's run (still QUEUED) ready again, not the first's (started). Resumed, the
    second half starts its run too: both are handed out, each holding its slot once, and neither
    is handed out again. Before, the second ran with its message ready and no slot."""
    h = private
    q = h.engine.resources.queue
    repo = h.engine.resources.repo.runs
    real = repo.dequeue_and_start
    stalled, go = asyncio.Event(), asyncio.Event()
    calls = 0

    async def dequeue_and_start(starts: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise _RunsData("a value out of range")  # the whole batch: split in halves
        if calls == 3:  # the second half
            stalled.set()
            await go.wait()
        return await real(starts, *args, **kwargs)

    repo.dequeue_and_start = dequeue_and_start  # type: ignore[method-assign]
    try:
        runs = [await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello")) for _ in range(2)]
        first = asyncio.create_task(h.engine.dequeue(h.env.worker_group_id, 2, start=True))
        await asyncio.wait_for(stalled.wait(), 10)
        h.clock.advance(31)  # held longer than the grace
        assert (await h.engine.systems.reconciler.reconcile(grace_s=-1, full=True)).requeued_stuck >= 1
        go.set()
        got = await asyncio.wait_for(first, 10)
    finally:
        go.set()
        repo.dequeue_and_start = real  # type: ignore[method-assign]
    assert sorted(d.run.id for d in got) == sorted(r.id for r in runs)
    assert all(d.started is not None for d in got)
    assert {r.id for r in runs} <= await q.running_ids(h.env.env_id)
    assert not {d.run.id for d in await h.engine.dequeue(h.env.worker_group_id, 5)} & {r.id for r in runs}
    assert {r.id for r in runs} <= await q.running_ids(h.env.env_id)
    for d in got:
        assert d.started is not None
        await h.engine.complete_attempt(d.run.id, d.started.snapshot.id, ok=True)
    assert not {r.id for r in runs} & await q.running_ids(h.env.env_id)
    assert (await q.queue_stats(h.env.env_id, runs[0].queue)).queued == 0


async def executing_run_heartbeat_job(h: Harness) -> str:
    """Both epochs marked, then a run started: the id of its heartbeat job."""
    engine = h.engine
    await engine.systems.reconciler.reconcile(grace_s=-1)
    run = await engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    (d,) = await engine.dequeue(h.env.worker_group_id, 1)
    started = await engine.start_attempt(run.id, d.snapshot.id)
    return f"hb.{run.id}.{started.snapshot.id}"
