"""A Redis call that fails after its PostgreSQL change committed (a master lost in a failover, a
connection refused) does not fail the change: the caller gets its answer (a worker told "failed"
would give the run up), and what the call would have done is repaired later: a lost job by the
run's heartbeat or the leader's re-arm, a lost enqueue or ack by the reconciler."""

from __future__ import annotations

from typing import Any

import pytest

from run_engine.engine import TriggerRequest
from run_engine.statuses import RunStatus

from .conftest import Harness

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


def req(h: Harness, **kw: Any) -> TriggerRequest:
    return TriggerRequest(env_id=h.env.env_id, task_id="hello", **kw)


def redis_down(monkeypatch: pytest.MonkeyPatch, h: Harness, *names: str) -> list[str]:
    """Make the resources' ``names`` (change_jobs, ack_many, enqueue_items) fail; the calls made."""
    calls: list[str] = []

    def failing(name: str) -> Any:
        async def call(*args: object, **kwargs: object) -> None:
            calls.append(name)
            raise ConnectionError(f"{name}: Redis is down")
        return call

    for name in names:
        monkeypatch.setattr(h.engine.resources, name, failing(name))
    return calls


async def test_a_start_whose_jobs_call_fails_is_started_and_its_heartbeat_arms_the_timeout(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    run = await h.engine.trigger(req(h))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1)
    calls = redis_down(monkeypatch, h, "change_jobs")
    started = await h.engine.start_attempt(run.id, d.snapshot.id)
    monkeypatch.undo()
    assert calls == ["change_jobs"] and started.snapshot.engine_status == "EXECUTING"
    job = f"hb.{run.id}.{started.snapshot.id}"
    assert await h.engine.resources.jobs.missing([job]) == [job]
    await h.engine.heartbeat(run.id, started.snapshot.id)
    assert await h.engine.resources.jobs.missing([job]) == []


async def test_a_completion_whose_ack_fails_is_taken_and_the_reconciler_frees_the_slot(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    run = await h.engine.trigger(req(h))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1)
    started = await h.engine.start_attempt(run.id, d.snapshot.id)
    calls = redis_down(monkeypatch, h, "ack_many", "change_jobs")
    done = await h.engine.complete_attempt(run.id, started.snapshot.id, ok=True, output=1)
    monkeypatch.undo()
    assert done.status == RunStatus.COMPLETED and sorted(calls) == ["ack_many", "change_jobs"]
    assert run.id in await h.engine.resources.queue.running_ids(h.env.env_id)  # the slot the ack missed
    await h.engine.systems.reconciler.reconcile(grace_s=-1)
    assert run.id not in await h.engine.resources.queue.running_ids(h.env.env_id)


async def test_a_retry_whose_jobs_call_fails_is_still_enqueued(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    run = await h.engine.trigger(req(h, retry={"max_attempts": 3, "min_delay_ms": 0, "max_delay_ms": 0,
                                               "factor": 1, "randomize": False}))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1)
    started = await h.engine.start_attempt(run.id, d.snapshot.id)
    calls = redis_down(monkeypatch, h, "change_jobs")
    out = await h.engine.complete_attempt(run.id, started.snapshot.id, ok=False, error={"message": "boom"})
    monkeypatch.undo()
    assert out.status == RunStatus.QUEUED and calls == ["change_jobs"]
    h.clock.advance(1)
    (again,) = await h.engine.dequeue(h.env.worker_group_id, 1)
    assert again.run.id == run.id and again.run.attempt_number == 1


async def test_a_token_completion_whose_enqueue_fails_is_taken_and_the_reconciler_restores_the_run(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    run = await h.engine.trigger(req(h))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1)
    started = await h.engine.start_attempt(run.id, d.snapshot.id)
    token, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    out = await h.engine.block(run.id, started.snapshot.id, sequence=0, kind="token", key=token.id,
                               waitpoint_ids=[token.id])
    await h.engine.suspend(run.id, out.snapshot.id)
    calls = redis_down(monkeypatch, h, "enqueue_items")
    assert await h.engine.waitpoints.complete(token.id, {"ok": 1})
    monkeypatch.undo()
    assert calls == ["enqueue_items"]
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "QUEUED_EXECUTING"
    assert [g for g in await h.engine.dequeue(h.env.worker_group_id, 5) if g.run.id == run.id] == []
    assert (await h.engine.systems.reconciler.reconcile(grace_s=-1)).requeued_missing >= 1
    got = await h.engine.dequeue(h.env.worker_group_id, 5)
    assert [g.run.id for g in got if g.run.id == run.id] == [run.id]


async def test_a_token_stored_before_its_timeout_job_failed_gets_the_job_when_the_call_is_repeated(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Creating a waitpoint is not a worker's state change: its failure is answered (503) and the
    client repeats the call with its idempotency key, which then arms the job the first missed."""
    calls = redis_down(monkeypatch, h, "change_jobs")
    with pytest.raises(ConnectionError):
        await h.engine.waitpoints.create_token(h.env.env_id, idempotency_key="k", timeout_s=60)
    monkeypatch.undo()
    assert calls == ["change_jobs"]
    token, cached = await h.engine.waitpoints.create_token(h.env.env_id, idempotency_key="k", timeout_s=60)
    assert cached
    job = f"wpto.{token.id}"
    assert await h.engine.resources.jobs.missing([job]) == []
    h.clock.advance(61)
    await h.engine.run_due_jobs()
    done = await h.engine.waitpoints.get(token.id)
    assert done is not None and done.status == "COMPLETED" and done.output_is_error


async def test_a_cancel_whose_queue_removal_fails_is_answered_and_the_next_dequeue_drops_the_message(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    run = await h.engine.trigger(req(h))
    removed: list[str] = []

    async def remove(env_id: str, run_id: str) -> None:
        removed.append(run_id)
        raise ConnectionError("Redis is down")

    monkeypatch.setattr(h.engine.resources.queue, "remove", remove)
    assert await h.engine.cancel(run.id) == RunStatus.CANCELED  # committed: answered, not raised
    monkeypatch.undo()
    assert removed == [run.id]
    got = await h.engine.get_run(run.id)
    assert got is not None and got.status == RunStatus.CANCELED
    assert await h.engine.dequeue(h.env.worker_group_id, 5) == []  # its message is dropped, not handed out
    assert run.id not in await h.engine.resources.queue.running_ids(h.env.env_id)
    assert await h.engine.dequeue(h.env.worker_group_id, 5) == []


async def test_a_dequeue_whose_run_cannot_be_prepared_hands_out_the_others(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """One run's attempt that cannot be worked out after the dequeue committed (its retry options,
    its journal) stopped the whole dequeue: every run of it (of any tenant) stayed EXECUTING with
    no heartbeat job and no worker. Now only that run is held back, and its timeout is armed."""
    from systems import engine_jobs

    await h.deploy({"id": "hello"})
    bad = await h.engine.trigger(req(h, payload="bad"))
    good = await h.engine.trigger(req(h, payload="good"))
    attempts = h.engine.systems.run_attempt
    real = attempts.retry_policy

    async def policy(run: Any) -> Any:
        if run.id == bad.id:
            raise RuntimeError("this run's policy cannot be worked out")
        return await real(run)

    monkeypatch.setattr(attempts, "retry_policy", policy)
    handed = await h.engine.dequeue(h.env.worker_group_id, 5, start=True)
    assert [d.run.id for d in handed] == [good.id] and handed[0].started is not None
    latest = await h.engine.latest_snapshot(bad.id)
    assert latest.engine_status == "EXECUTING"
    assert await h.engine.resources.jobs.missing([engine_jobs.heartbeat_id(bad.id, latest.id)]) == []
