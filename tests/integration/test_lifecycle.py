"""Every transition of DESIGN.md §5 that the spine builds, on real PostgreSQL and Redis."""

from __future__ import annotations

from typing import Any

import pytest

from run_engine.engine import TriggerRequest
from run_engine.errors import InvalidTransitionError, StaleSnapshotError
from run_engine.statuses import RunStatus
from systems import engine_jobs

from .conftest import Harness

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


def req(h: Harness, task: str = "hello", **kw: object) -> TriggerRequest:
    return TriggerRequest(env_id=h.env.env_id, task_id=task, **kw)  # type: ignore[arg-type]


async def dequeue_one(h: Harness):  # type: ignore[no-untyped-def]
    got = await h.engine.dequeue(h.env.worker_group_id, 1)
    assert len(got) == 1, got
    return got[0]


async def test_trigger_to_completed_with_full_snapshot_history(h: Harness) -> None:
    run = await h.engine.trigger(req(h, payload={"n": 1}))
    assert run.status == RunStatus.QUEUED
    d = await dequeue_one(h)
    assert d.run.id == run.id and d.run.payload == {"n": 1} and d.snapshot.engine_status == "PENDING_EXECUTING"
    started = await h.engine.start_attempt(run.id, d.snapshot.id)
    assert started.attempt_number == 1 and started.snapshot.engine_status == "EXECUTING"
    outcome = await h.engine.complete_attempt(run.id, started.snapshot.id, ok=True, output={"ok": 1})
    assert outcome.action == "finished" and outcome.status == RunStatus.COMPLETED
    row = await h.engine.get_run(run.id)
    assert row is not None and row.status == "COMPLETED" and row.output == {"ok": 1}
    assert row.started_at is not None and row.finished_at is not None
    assert await h.statuses(run.id) == ["QUEUED", "PENDING_EXECUTING", "EXECUTING", "FINISHED"]
    snaps = await h.engine.snapshots(run.id)
    assert [s.previous_snapshot_id for s in snaps[1:]] == [s.id for s in snaps[:-1]]
    assert h.names(run.id) == ["run_created", "run_dequeued", "attempt_started", "run_succeeded"]
    # the slot is free again: nothing held in the queue
    assert await h.engine.resources.queue.running_ids(h.env.env_id) == set()


async def test_dequeue_that_starts_keeps_both_snapshots_in_one_transaction(h: Harness) -> None:
    runs = [await h.engine.trigger(req(h, payload={"n": i}, ttl_s=30, max_duration_s=600)) for i in range(3)]
    got = await h.engine.dequeue(h.env.worker_group_id, 5, "worker-1", start=True)
    assert sorted(d.run.id for d in got) == sorted(r.id for r in runs)
    jobs = h.engine.resources.jobs
    for d in got:
        assert d.snapshot.engine_status == "PENDING_EXECUTING" and d.started is not None
        started = d.started
        assert started.attempt_number == 1 and started.snapshot.engine_status == "EXECUTING"
        assert started.snapshot.previous_snapshot_id == d.snapshot.id and started.max_duration_s == 600
        assert started.run.started_at is not None and started.run.payload == d.run.payload
        assert await h.statuses(d.run.id) == ["QUEUED", "PENDING_EXECUTING", "EXECUTING"]
        assert h.names(d.run.id) == ["run_created", "run_dequeued", "attempt_started"]
        # the jobs are the started attempt's (heartbeat, max duration): no TTL, no PENDING_EXECUTING timeout
        assert await jobs.get(engine_jobs.heartbeat_id(d.run.id, started.snapshot.id)) is not None
        assert await jobs.get(engine_jobs.max_duration_id(d.run.id, 1)) is not None
        assert await jobs.get(engine_jobs.heartbeat_id(d.run.id, d.snapshot.id)) is None
        assert await jobs.get(engine_jobs.ttl_id(d.run.id)) is None
    await h.advance(45)  # past the TTL: a started run does not expire
    assert all([(await h.engine.latest_snapshot(d.run.id)).engine_status == "EXECUTING" for d in got])
    first = got[0]
    assert first.started is not None
    with pytest.raises(StaleSnapshotError):  # the PENDING_EXECUTING snapshot cannot be started twice
        await h.engine.start_attempt(first.run.id, first.snapshot.id)
    await h.engine.complete_attempt(first.run.id, first.started.snapshot.id, ok=True, output=1)
    assert (await h.engine.get_run(first.run.id)).status == "COMPLETED"  # type: ignore[union-attr]
    # the others still hold their slots; their heartbeat timeout (60 s from the start) retries them
    assert await h.engine.resources.queue.running_ids(h.env.env_id) == {d.run.id for d in got[1:]}


async def test_dequeue_that_starts_resumes_a_restored_run(h: Harness) -> None:
    """A run dequeued after a suspension resumes its attempt (no new attempt) when the dequeue
    starts it, as a separate start would."""
    run = await h.engine.trigger(req(h))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1, start=True)
    assert d.started is not None
    token, _ = await h.engine.create_token(h.env.env_id, timeout_s=3600)
    blocked = await h.engine.block(run.id, d.started.snapshot.id, sequence=0, kind="token", key=token.id,
                                   waitpoint_ids=[token.id])
    assert blocked.blocked
    await h.engine.suspend(run.id, blocked.snapshot.id)
    assert await h.engine.complete_waitpoint(token.id, {"x": 1})
    (again,) = await h.engine.dequeue(h.env.worker_group_id, 1, start=True)
    assert again.started is not None and again.started.attempt_number == 1  # the same attempt, by replay
    assert again.started.snapshot.checkpoint_id is not None and again.snapshot.checkpoint_id is not None
    await h.engine.complete_attempt(run.id, again.started.snapshot.id, ok=True, output=2)
    assert (await h.engine.get_run(run.id)).status == "COMPLETED"  # type: ignore[union-attr]
    assert await h.statuses(run.id) == [
        "QUEUED", "PENDING_EXECUTING", "EXECUTING", "EXECUTING_WITH_WAITPOINTS", "SUSPENDED",
        "QUEUED_EXECUTING", "PENDING_EXECUTING", "EXECUTING", "FINISHED"]


async def test_dequeue_that_starts_writes_what_a_dequeue_then_a_start_write(h: Harness) -> None:
    """One statement appends both snapshots (``RunRepository.dequeue_and_start``): the same
    snapshots and run row as a dequeue followed by a start, for a first attempt and for a retry;
    the dequeued run is seen as the dequeue left it (before the start)."""
    run = await h.engine.trigger(req(h))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1, "worker-1", start=True)
    assert d.started is not None
    assert (d.run.status, d.run.attempt_number, d.run.started_at) == ("DEQUEUED", 0, None)
    first = d.started.run.started_at
    assert (d.started.run.status, d.started.run.attempt_number) == ("EXECUTING", 1) and first is not None
    outcome = await h.engine.complete_attempt(run.id, d.started.snapshot.id, ok=False,
                                              error={"type": "Error", "message": "once"})
    assert outcome.action == "retry" and outcome.delay_ms is not None
    await h.advance(outcome.delay_ms / 1000 + 1)
    (d2,) = await h.engine.dequeue(h.env.worker_group_id, 1, "worker-2", start=True)
    assert d2.started is not None and d2.started.attempt_number == 2
    assert (d2.run.status, d2.run.attempt_number, d2.run.started_at) == ("DEQUEUED", 1, first)
    assert (d2.started.run.attempt_number, d2.started.run.started_at) == (2, first)
    row = await h.engine.get_run(run.id)
    assert row is not None and (row.status, row.attempt_number, row.started_at) == ("EXECUTING", 2, first)
    snaps = await h.engine.snapshots(run.id)
    assert [(s.engine_status, s.run_status, s.attempt_number, s.worker_id, s.description) for s in snaps[-2:]] == [
        ("PENDING_EXECUTING", "DEQUEUED", 1, "worker-2", "Dequeued by a worker"),
        ("EXECUTING", "EXECUTING", 2, "worker-2", "Attempt started")]
    assert snaps[-1].previous_snapshot_id == snaps[-2].id and snaps[-2].previous_snapshot_id == snaps[-3].id


async def test_retry_after_failure_waits_the_policy_delay(h: Harness) -> None:
    run = await h.engine.trigger(req(h))
    delays = []
    for attempt in (1, 2):
        d = await dequeue_one(h)
        started = await h.engine.start_attempt(run.id, d.snapshot.id)
        assert started.attempt_number == attempt
        outcome = await h.engine.complete_attempt(run.id, started.snapshot.id, ok=False,
                                                  error={"type": "Error", "message": f"boom {attempt}"})
        assert outcome.action == "retry"
        delays.append(outcome.delay_ms)
        # invisible until the back-off has passed
        h.clock.advance(outcome.delay_ms / 1000 - 0.05)  # type: ignore[operator]
        assert await h.engine.dequeue(h.env.worker_group_id, 1) == []
        h.clock.advance(0.05)
    assert delays == [1000, 2000]  # min 1 s, factor 2, no jitter
    d = await dequeue_one(h)
    started = await h.engine.start_attempt(run.id, d.snapshot.id)
    outcome = await h.engine.complete_attempt(run.id, started.snapshot.id, ok=False,
                                              error={"type": "Error", "message": "boom 3"})
    assert outcome.action == "finished" and outcome.status == RunStatus.FAILED
    row = await h.engine.get_run(run.id)
    assert row is not None and row.status == "FAILED" and row.attempt_number == 3
    assert row.error == {"type": "Error", "message": "boom 3"}
    assert h.names(run.id).count("retry_scheduled") == 2


async def test_task_retry_policy_and_trigger_override(h: Harness) -> None:
    await h.deploy({"id": "flaky", "retry": {"maxAttempts": 2, "minTimeout": 5, "factor": 3, "randomize": False}},
                   version="2")
    run = await h.engine.trigger(req(h, "flaky"))
    d = await dequeue_one(h)
    s = await h.engine.start_attempt(run.id, d.snapshot.id)
    assert s.retry.max_attempts == 2
    out = await h.engine.complete_attempt(run.id, s.snapshot.id, ok=False, error={"type": "E", "message": "x"})
    assert out.delay_ms == 5000
    one_shot = await h.engine.trigger(req(h, "flaky", max_attempts=1))
    d = await dequeue_one(h)
    s = await h.engine.start_attempt(one_shot.id, d.snapshot.id)
    out = await h.engine.complete_attempt(one_shot.id, s.snapshot.id, ok=False, error={"type": "E", "message": "x"})
    assert out.action == "finished" and out.status == RunStatus.FAILED


async def test_non_retryable_error_ends_the_run_at_once(h: Harness) -> None:
    run = await h.engine.trigger(req(h))
    d = await dequeue_one(h)
    s = await h.engine.start_attempt(run.id, d.snapshot.id)
    out = await h.engine.complete_attempt(run.id, s.snapshot.id, ok=False, retryable=False,
                                          error={"type": "ABORT", "message": "no"})
    assert out.action == "finished" and out.status == RunStatus.FAILED


async def test_stale_snapshot_id_is_rejected_and_changes_nothing(h: Harness) -> None:
    run = await h.engine.trigger(req(h))
    d = await dequeue_one(h)
    with pytest.raises(StaleSnapshotError) as info:
        await h.engine.start_attempt(run.id, run.snapshot_id)
    assert info.value.latest_snapshot_id == d.snapshot.id and info.value.latest_status == "PENDING_EXECUTING"
    s = await h.engine.start_attempt(run.id, d.snapshot.id)
    with pytest.raises(StaleSnapshotError):
        await h.engine.complete_attempt(run.id, d.snapshot.id, ok=True, output=1)
    with pytest.raises(StaleSnapshotError):
        await h.engine.heartbeat(run.id, d.snapshot.id)
    assert await h.statuses(run.id) == ["QUEUED", "PENDING_EXECUTING", "EXECUTING"]
    await h.engine.complete_attempt(run.id, s.snapshot.id, ok=True, output=1)
    with pytest.raises((StaleSnapshotError, InvalidTransitionError)):
        await h.engine.complete_attempt(run.id, s.snapshot.id, ok=True, output=2)
    row = await h.engine.get_run(run.id)
    assert row is not None and row.output == 1


async def test_pending_executing_heartbeat_timeout_requeues(h: Harness) -> None:
    run = await h.engine.trigger(req(h))
    d = await dequeue_one(h)
    assert d.deliveries == 1
    await h.advance(30)
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "PENDING_EXECUTING"
    await h.advance(31)  # past the 60 s PENDING_EXECUTING timeout
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "QUEUED"
    assert "run_requeued" in h.names(run.id)
    await h.advance(3600)  # past the nack back-off
    d2 = await dequeue_one(h)
    assert d2.run.id == run.id and d2.deliveries == 2


async def test_executing_heartbeat_timeout_fails_the_attempt_and_retries(h: Harness) -> None:
    run = await h.engine.trigger(req(h))
    d = await dequeue_one(h)
    s = await h.engine.start_attempt(run.id, d.snapshot.id)
    await h.advance(50)
    await h.engine.heartbeat(run.id, s.snapshot.id)  # pushes the timeout back
    await h.advance(50)
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "EXECUTING"
    await h.advance(61)
    latest = await h.engine.latest_snapshot(run.id)
    assert latest.engine_status == "QUEUED"
    row = await h.engine.get_run(run.id)
    assert row is not None and row.error is not None and row.error["code"] == "TASK_RUN_STALLED_EXECUTING"
    h.clock.advance(1)
    d2 = await dequeue_one(h)
    s2 = await h.engine.start_attempt(run.id, d2.snapshot.id)
    assert s2.attempt_number == 2
    await h.engine.complete_attempt(run.id, s2.snapshot.id, ok=True, output="late")
    assert (await h.engine.get_run(run.id)).status == "COMPLETED"  # type: ignore[union-attr]


async def test_cancel_in_each_state(h: Harness) -> None:
    q = h.env.worker_group_id
    # PENDING_VERSION: no deployment has the task
    pv = await h.engine.trigger(req(h, "not-deployed"))
    assert pv.status == RunStatus.PENDING_VERSION
    assert await h.engine.cancel(pv.id) == RunStatus.CANCELED
    # QUEUED
    queued = await h.engine.trigger(req(h))
    assert await h.engine.cancel(queued.id) == RunStatus.CANCELED
    assert await h.engine.dequeue(q, 5) == []
    # PENDING_EXECUTING
    pe = await h.engine.trigger(req(h))
    d = await dequeue_one(h)
    assert await h.engine.cancel(pe.id) == RunStatus.CANCELED
    with pytest.raises(StaleSnapshotError):
        await h.engine.start_attempt(pe.id, d.snapshot.id)
    # EXECUTING → PENDING_CANCEL → the worker reports → CANCELED
    ex = await h.engine.trigger(req(h))
    d = await dequeue_one(h)
    s = await h.engine.start_attempt(ex.id, d.snapshot.id)
    assert await h.engine.cancel(ex.id) == RunStatus.EXECUTING
    assert (await h.engine.latest_snapshot(ex.id)).engine_status == "PENDING_CANCEL"
    out = await h.engine.complete_attempt(ex.id, s.snapshot.id, ok=True, output=1)
    assert out.status == RunStatus.CANCELED
    # EXECUTING → PENDING_CANCEL → the worker is gone → heartbeat timeout → CANCELED
    gone = await h.engine.trigger(req(h))
    d = await dequeue_one(h)
    await h.engine.start_attempt(gone.id, d.snapshot.id)
    await h.engine.cancel(gone.id)
    await h.advance(61)
    # FINISHED: a no-op
    assert await h.engine.cancel(gone.id) == RunStatus.CANCELED
    for run_id in (pv.id, queued.id, pe.id, ex.id, gone.id):
        row = await h.engine.get_run(run_id)
        assert row is not None and row.status == "CANCELED", (run_id, row and row.status)
        assert (await h.engine.latest_snapshot(run_id)).engine_status == "FINISHED"
    assert await h.engine.resources.queue.running_ids(h.env.env_id) == set()


async def test_nack_past_the_limit_dead_letters_then_redrive_completes(make_engine) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await make_engine(max_deliveries=3)
    await h.deploy({"id": "hello"})
    run = await h.engine.trigger(req(h))
    for _ in range(3):
        await dequeue_one(h)
        await h.advance(61)  # PENDING_EXECUTING timeout → nack
        h.clock.advance(3600)  # past the back-off
    row = await h.engine.get_run(run.id)
    assert row is not None and row.status == "SYSTEM_FAILURE"
    assert row.error is not None and row.error["code"] == "TASK_RUN_DEQUEUED_MAX_RETRIES"
    assert "run_dead_lettered" in h.names(run.id)
    dlq = await h.engine.resources.queue.list_dlq(h.env.env_id)
    assert [e.run_id for e in dlq] == [run.id]
    assert await h.engine.dequeue(h.env.worker_group_id, 5) == []

    await h.engine.redrive(h.env.env_id, run.id)
    assert (await h.engine.get_run(run.id)).status == "QUEUED"  # type: ignore[union-attr]
    assert await h.engine.resources.queue.list_dlq(h.env.env_id) == []
    d = await dequeue_one(h)
    assert d.deliveries == 1
    s = await h.engine.start_attempt(run.id, d.snapshot.id)
    await h.engine.complete_attempt(run.id, s.snapshot.id, ok=True, output="redriven")
    row = await h.engine.get_run(run.id)
    assert row is not None and row.status == "COMPLETED" and row.error is None and row.finished_at is not None


async def test_pending_version_runs_are_enqueued_when_a_deployment_registers(h: Harness) -> None:
    first = await h.engine.trigger(req(h, "later", payload=1))
    second = await h.engine.trigger(req(h, "later", payload=2))
    assert first.status == second.status == RunStatus.PENDING_VERSION
    assert await h.engine.dequeue(h.env.worker_group_id, 5) == []
    await h.deploy({"id": "hello"}, {"id": "later", "queue": "later-q"}, version="2")
    got = await h.engine.dequeue(h.env.worker_group_id, 5)
    assert [d.run.id for d in got] == [first.id, second.id]  # they kept their place
    assert {d.run.queue for d in got} == {"later-q"}
    assert await h.statuses(first.id) == ["PENDING_VERSION", "QUEUED", "PENDING_EXECUTING"]


async def test_max_duration_times_the_run_out(h: Harness) -> None:
    run = await h.engine.trigger(req(h, max_duration_s=10))
    d = await dequeue_one(h)
    s = await h.engine.start_attempt(run.id, d.snapshot.id)
    await h.engine.heartbeat(run.id, s.snapshot.id)
    await h.advance(16)  # 10 s + grace
    row = await h.engine.get_run(run.id)
    assert row is not None and row.status == "TIMED_OUT"
    # the worker's late completion is refused
    with pytest.raises(StaleSnapshotError):
        await h.engine.complete_attempt(run.id, s.snapshot.id, ok=True, output=1)


async def test_max_duration_error_from_the_worker_is_final(h: Harness) -> None:
    run = await h.engine.trigger(req(h))
    d = await dequeue_one(h)
    s = await h.engine.start_attempt(run.id, d.snapshot.id)
    out = await h.engine.complete_attempt(run.id, s.snapshot.id, ok=False,
                                          error={"type": "MAX_DURATION_EXCEEDED", "message": "too slow"})
    assert out.status == RunStatus.TIMED_OUT


async def test_queue_concurrency_limit_holds_through_the_engine(h: Harness) -> None:
    a = await h.engine.trigger(req(h, "limited"))
    b = await h.engine.trigger(req(h, "limited"))
    got = await h.engine.dequeue(h.env.worker_group_id, 5)
    assert [x.run.id for x in got] == [a.id]
    s = await h.engine.start_attempt(a.id, got[0].snapshot.id)
    assert await h.engine.dequeue(h.env.worker_group_id, 5) == []
    await h.engine.complete_attempt(a.id, s.snapshot.id, ok=True, output=None)
    got = await h.engine.dequeue(h.env.worker_group_id, 5)
    assert [x.run.id for x in got] == [b.id]


async def test_many_concurrent_lifecycles_share_batches(h: Harness) -> None:
    import asyncio

    runs = await h.engine.trigger_many([req(h, payload=i) for i in range(60)])
    done: list[str] = []

    async def consumer() -> None:
        while True:
            got = await h.engine.dequeue(h.env.worker_group_id, 5)
            if not got:
                return
            for d in got:
                s = await h.engine.start_attempt(d.run.id, d.snapshot.id)
                await h.engine.complete_attempt(d.run.id, s.snapshot.id, ok=True, output=d.run.payload)
                done.append(d.run.id)

    await asyncio.gather(*(consumer() for _ in range(6)))
    assert sorted(done) == sorted(r.id for r in runs)
    for r in runs[:5]:
        assert (await h.engine.get_run(r.id)).status == "COMPLETED"  # type: ignore[union-attr]


async def test_a_heartbeat_timeout_due_while_the_engine_was_down_gives_the_worker_a_timeout_first(h: Harness) -> None:
    """The engine was down for longer than the heartbeat timeout (no heartbeat could be heard) and
    starts again: the overdue timeout does not fail the attempt (its worker most likely still runs
    it, and would run beside a retry); the worker gets one timeout from the start. A worker that
    is really gone is still caught once that has passed."""
    from run_engine.engine import RunEngine

    await h.deploy({"id": "t"})
    alive, gone = await h.engine.trigger(req(h)), await h.engine.trigger(req(h))
    started: dict[str, Any] = {}
    for d in await h.engine.dequeue(h.env.worker_group_id, 2, "w"):
        started[d.run.id] = await h.engine.start_attempt(d.run.id, d.snapshot.id)
    before = h.engine
    h.clock.advance(300)  # the engine is down for five minutes, and starts again
    h.engine = await RunEngine.create(before.resources.settings, clock=h.clock, run_jobs=False)
    try:
        await _after_the_restart(h, alive, gone, started)
    finally:
        await h.engine.close()
        h.engine = before


async def _after_the_restart(h: Harness, alive: Any, gone: Any, started: dict[str, Any]) -> None:
    assert await h.engine.run_due_jobs() == 2  # both timeouts were overdue: armed again, not failed
    for run in (alive, gone):
        assert (await h.engine.latest_snapshot(run.id)).engine_status == "EXECUTING"
    await h.advance(5)
    await h.engine.heartbeat(alive.id, started[alive.id].snapshot.id)  # its worker retries and is heard
    await h.advance(56)  # one timeout since the start: the silent one is failed, the other is not
    assert (await h.engine.latest_snapshot(alive.id)).engine_status == "EXECUTING"
    row = await h.engine.get_run(gone.id)
    assert row is not None and row.error is not None and row.error["code"] == "TASK_RUN_STALLED_EXECUTING"
    await h.engine.complete_attempt(alive.id, started[alive.id].snapshot.id, ok=True, output="done")
    assert (await h.engine.get_run(alive.id)).status == "COMPLETED"  # type: ignore[union-attr]


async def test_a_heartbeat_timeout_due_while_redis_was_away_gives_the_worker_a_timeout_first(h: Harness) -> None:
    """Redis away for longer than the timeout (heartbeats refused): once the engine reaches it
    again, an overdue timeout is armed again for one timeout instead of failing the attempt."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    run = await h.engine.trigger(req(h))
    d = await dequeue_one(h)
    s = await h.engine.start_attempt(run.id, d.snapshot.id)
    jobs = h.engine.resources.jobs
    h.clock.advance(120)
    real = jobs.redis

    class Away:
        def __getattr__(self, name: str) -> Any:
            raise RedisConnectionError("Redis is away")

    jobs.redis = Away()  # type: ignore[assignment]
    with pytest.raises(RedisConnectionError):
        await h.engine.heartbeat(run.id, s.snapshot.id)
    jobs.redis = real
    assert await h.engine.run_due_jobs() == 1
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "EXECUTING"
    await h.engine.heartbeat(run.id, s.snapshot.id)
    await h.advance(59)
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "EXECUTING"
    await h.advance(61)
    row = await h.engine.get_run(run.id)
    assert row is not None and row.error is not None and row.error["code"] == "TASK_RUN_STALLED_EXECUTING"


async def test_a_heartbeat_timeout_is_given_more_time_once_per_snapshot(h: Harness) -> None:
    """Redis failing now and then (one call in each timeout) must not keep a dead worker's run
    EXECUTING forever: a snapshot's timeout is armed again once at most."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    run = await h.engine.trigger(req(h))
    d = await dequeue_one(h)
    s = await h.engine.start_attempt(run.id, d.snapshot.id)
    jobs = h.engine.resources.jobs
    real = jobs.redis

    class Away:
        def __getattr__(self, name: str) -> Any:
            raise RedisConnectionError("Redis is away")

    async def blip() -> None:
        jobs.redis = Away()  # type: ignore[assignment]
        with pytest.raises(RedisConnectionError):
            await jobs.stats()
        with pytest.raises(RedisConnectionError):
            await h.engine.heartbeat(run.id, s.snapshot.id)
        jobs.redis = real
        await jobs.stats()  # reached again: heard from now on

    h.clock.advance(61)
    await blip()
    assert await h.engine.run_due_jobs() == 1  # due while nothing could be heard: armed again
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "EXECUTING"
    h.clock.advance(59)
    await blip()  # Redis away again just before the new deadline
    await h.advance(2)
    row = await h.engine.get_run(run.id)
    assert row is not None and row.error is not None and row.error["code"] == "TASK_RUN_STALLED_EXECUTING"
