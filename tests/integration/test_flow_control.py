"""Delays, reschedule, TTL and idempotency keys (issue 5), on real PostgreSQL and Redis with a fake clock."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from run_engine.engine import TriggerRequest
from run_engine.errors import InvalidTransitionError
from run_engine.statuses import RunStatus

from .conftest import Harness

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


def req(h: Harness, task: str = "hello", **kw: object) -> TriggerRequest:
    return TriggerRequest(env_id=h.env.env_id, task_id=task, **kw)  # type: ignore[arg-type]


def at(h: Harness, seconds: float) -> datetime:
    return datetime.fromtimestamp(h.clock.now() + seconds, UTC)


async def test_delayed_run_is_enqueued_when_due(h: Harness) -> None:
    run = await h.engine.trigger(req(h, delay_until=at(h, 60)))
    assert run.status == RunStatus.DELAYED
    row = await h.engine.get_run(run.id)
    assert row is not None and row.delay_until is not None
    assert await h.engine.dequeue(h.env.worker_group_id, 5) == []
    await h.advance(59)
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "DELAYED"
    await h.advance(1.5)
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "QUEUED"
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)
    assert d.run.id == run.id
    assert await h.statuses(run.id) == ["DELAYED", "QUEUED", "PENDING_EXECUTING"]


async def test_delayed_run_takes_its_place_when_due_not_when_triggered(h: Harness) -> None:
    delayed = await h.engine.trigger(req(h, "limited", delay_until=at(h, 10)))
    h.clock.advance(5)
    early = await h.engine.trigger(req(h, "limited"))
    await h.advance(6)
    later = await h.engine.trigger(req(h, "limited"))
    order = []
    for _ in range(3):
        (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)
        order.append(d.run.id)
        s = await h.engine.start_attempt(d.run.id, d.snapshot.id)
        await h.engine.complete_attempt(d.run.id, s.snapshot.id, ok=True)
    assert order == [early.id, delayed.id, later.id]


async def test_reschedule_moves_the_date_and_refuses_runs_that_are_not_delayed(h: Harness) -> None:
    run = await h.engine.trigger(req(h, delay_until=at(h, 10)))
    row = await h.engine.reschedule(h.env.env_id, run.id, at(h, 100))
    assert row.delay_until is not None and row.delay_until.timestamp() == pytest.approx(h.clock.now() + 100)
    await h.advance(20)
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "DELAYED"
    await h.advance(81)
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "QUEUED"
    with pytest.raises(InvalidTransitionError):
        await h.engine.reschedule(h.env.env_id, run.id, at(h, 10))


async def test_delayed_run_of_a_task_without_deployment_waits_for_one(h: Harness) -> None:
    run = await h.engine.trigger(req(h, "not-deployed", delay_until=at(h, 5)))
    await h.advance(6)
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "PENDING_VERSION"
    await h.deploy({"id": "hello"}, {"id": "not-deployed"}, version="2")
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "QUEUED"


async def test_ttl_expires_a_run_that_did_not_start_and_resumes_its_waiting_parent(h: Harness) -> None:
    await h.engine.pause_queue(h.env.env_id, "task/hello")
    lonely = await h.engine.trigger(req(h, ttl_s=30))
    await h.advance(31)
    row = await h.engine.get_run(lonely.id)
    assert row is not None and row.status == "EXPIRED" and row.error["type"] == "EXPIRED"  # type: ignore[index]
    assert await h.engine.resources.queue.has_messages([(h.env.env_id, lonely.id)]) == [False]  # out of the queue
    # a parent waiting on a child that expires resumes with the child's error
    await h.engine.resume_queue(h.env.env_id, "task/hello")
    parent = await h.engine.trigger(req(h, "limited"))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)
    s = await h.engine.start_attempt(parent.id, d.snapshot.id)
    await h.engine.pause_queue(h.env.env_id, "task/hello")
    (child,), out = await h.engine.trigger_and_wait(parent.id, s.snapshot.id, 0, [req(h, ttl_s=10)])
    assert out.blocked
    await h.advance(11)
    assert (await h.engine.get_run(child)).status == "EXPIRED"  # type: ignore[union-attr]
    (entry,) = (await h.engine.waitpoints.resolved_journal(parent.id)).entries
    assert entry["result"]["ok"] is False and entry["result"]["error"]["type"] == "EXPIRED"


async def test_a_started_run_and_its_retries_never_expire(h: Harness) -> None:
    run = await h.engine.trigger(req(h, ttl_s=5))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)
    s = await h.engine.start_attempt(run.id, d.snapshot.id)
    out = await h.engine.complete_attempt(run.id, s.snapshot.id, ok=False, error={"type": "E", "message": "x"})
    assert out.action == "retry"  # back in the queue, QUEUED again
    await h.advance(10)
    assert (await h.engine.get_run(run.id)).status == "QUEUED"  # type: ignore[union-attr]
    assert not await h.engine.systems.delayed_runs.expire(run.id)


async def test_max_ttl_setting_caps_every_run(make_engine) -> None:  # type: ignore[no-untyped-def]
    h = await make_engine(max_ttl_s=20)
    await h.deploy({"id": "hello"})
    await h.engine.pause_queue(h.env.env_id, "task/hello")
    capped = await h.engine.trigger(req(h, ttl_s=3600))
    default = await h.engine.trigger(req(h))
    await h.advance(21)
    for run in (capped, default):
        assert (await h.engine.get_run(run.id)).status == "EXPIRED"  # type: ignore[union-attr]


async def test_idempotency_key_returns_the_existing_run_until_its_ttl(h: Harness) -> None:
    first = await h.engine.trigger(req(h, idempotency_key="order-1", idempotency_key_ttl_s=60))
    again = await h.engine.trigger(req(h, idempotency_key="order-1", idempotency_key_ttl_s=60))
    assert not first.is_cached and again.is_cached and again.id == first.id
    other_task = await h.engine.trigger(req(h, "limited", idempotency_key="order-1"))
    assert not other_task.is_cached  # keys are per task
    h.clock.advance(61)
    fresh = await h.engine.trigger(req(h, idempotency_key="order-1", idempotency_key_ttl_s=60))
    assert not fresh.is_cached and fresh.id != first.id
    # only the uncached runs were enqueued
    got = await h.engine.dequeue(h.env.worker_group_id, 10)
    assert sorted(d.run.id for d in got) == sorted([first.id, other_task.id, fresh.id])


async def test_concurrent_triggers_with_one_key_create_one_run(h: Harness) -> None:
    results = await asyncio.gather(*(h.engine.trigger(req(h, idempotency_key="same")) for _ in range(50)))
    assert len({r.id for r in results}) == 1
    assert sum(not r.is_cached for r in results) == 1
    batch = await h.engine.trigger_many([req(h, idempotency_key="same"), req(h, idempotency_key="new"),
                                         req(h, idempotency_key="new")])
    assert batch[0].id == results[0].id and batch[0].is_cached
    assert batch[1].id == batch[2].id and not batch[1].is_cached and batch[2].is_cached
    assert len(await h.engine.dequeue(h.env.worker_group_id, 10)) == 2


async def test_a_declared_queue_is_custom_and_a_task_queue_is_task(h: Harness) -> None:
    await h.deploy({"id": "hello", "queue": "reports"}, {"id": "other"}, {"id": "third", "queue": "undeclared"},
                   queues=[{"name": "reports", "concurrencyLimit": 2}, {"name": "task/other", "concurrencyLimit": 3}])
    queues = {q.name: q for q in await h.engine.list_queues(h.env.env_id)}
    assert queues["undeclared"].type == "custom"  # named by a task, not declared
    assert queues["reports"].type == "custom" and queues["reports"].effective_limit == 2
    assert queues["task/other"].type == "task" and queues["task/other"].effective_limit == 3
    # a queue first made by a trigger naming it (custom), then declared: still custom, the declared limit
    await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", queue="nightly"))
    await h.deploy({"id": "hello"}, queues=[{"name": "nightly", "concurrencyLimit": 1}], version="2")
    nightly = await h.engine.task_queue(h.env.env_id, "nightly")
    assert nightly is not None and nightly.type == "custom" and nightly.effective_limit == 1


async def test_a_delayed_run_takes_the_deployment_of_the_group_it_was_routed_to(h: Harness) -> None:
    from run_engine.api.models import TaskDecl
    from run_engine.tenancy import create_worker_group

    gpu, _ = await create_worker_group(h.engine.resources.repo, secret="test-secret", name="gpu",
                                       project_id=h.env.project_id)
    # triggered before its group had a deployment of the task: it finds one when its delay is over
    run = await h.engine.trigger(req(h, "gpu-only", delay_until=at(h, 5), worker_group_id=gpu))
    await h.engine.register_deployment(env_id=h.env.env_id, worker_group_id=gpu, version="g1", content_hash="g1",
                                       tasks=[TaskDecl.model_validate({"id": "gpu-only"}).spec()], queues=[])
    await h.advance(6)
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "QUEUED"  # not PENDING_VERSION
    (d,) = await h.engine.dequeue(gpu, 5)
    assert d.run.id == run.id


async def test_a_ttl_job_of_an_earlier_date_does_not_expire_a_rescheduled_run(h: Harness) -> None:
    """The process died after a reschedule committed and before it moved the jobs: the old TTL job
    fires at the old date's end; the run's TTL runs from its new date."""
    run = await h.engine.trigger(req(h, delay_until=at(h, 10), ttl_s=20))
    await h.engine.resources.repo.runs.set_delay_until(run.id, at(h, 100))  # the jobs stay where they were
    h.clock.advance(31)
    assert not await h.engine.systems.delayed_runs.expire(run.id)
    assert (await h.engine.get_run(run.id)).status == "DELAYED"  # type: ignore[union-attr]
    await h.advance(100)  # its new date, then its TTL from there (the job moved): expired, never started
    assert (await h.engine.get_run(run.id)).status == "EXPIRED"  # type: ignore[union-attr]


async def test_a_trigger_repeated_with_its_key_gets_its_run_back_while_the_queue_is_full(make_engine) -> None:  # type: ignore[no-untyped-def]
    from run_engine.errors import QueueFullError

    h: Harness = await make_engine(max_queue_length=1)
    await h.deploy({"id": "hello"})
    first = await h.engine.trigger(req(h, idempotency_key="order-1"))  # the queue is full now
    again = await h.engine.trigger(req(h, idempotency_key="order-1"))
    assert again.id == first.id and again.is_cached
    with pytest.raises(QueueFullError):  # a run it would make is still refused
        await h.engine.trigger(req(h, idempotency_key="order-2"))


async def test_a_run_rescheduled_to_a_date_past_is_run_not_expired(h: Harness) -> None:
    """A trigger with a delay date already past makes a run queued now (its TTL counted from now);
    a reschedule to such a date (``POST …/reschedule {delay: "<yesterday>"}``, the dashboard's) is
    "now" too: the date kept as given made the TTL, counted from it, already passed (the run was
    expired the moment it was enqueued) and put the run ahead of its queue by that much."""
    waiting = await h.engine.trigger(req(h))  # queued before the reschedule: it stays ahead
    run = await h.engine.trigger(req(h, delay_until=at(h, 60), ttl_s=600))
    h.clock.advance(1)
    rescheduled = await h.engine.reschedule(h.env.env_id, run.id, at(h, -3600))  # "run it now" (an hour-old date)
    await h.advance(0.1)
    row = await h.engine.get_run(run.id)
    assert row is not None and row.status == "QUEUED", f"{row and row.status}: rescheduled to run now"
    assert rescheduled.delay_until is not None
    assert rescheduled.delay_until.timestamp() == pytest.approx(h.clock.now() - 0.1)  # the date is now
    await h.advance(598)  # its TTL runs from now, not from an hour ago
    assert (await h.engine.get_run(run.id)).status == "QUEUED"  # type: ignore[union-attr]
    got = [d.run.id for d in await h.engine.dequeue(h.env.worker_group_id, 5)]
    assert got == [waiting.id, run.id]  # its place in the queue is now, not an hour ago


async def test_a_run_handed_out_but_never_started_still_expires_after_its_requeue(h: Harness) -> None:
    """The TTL job finds the run PENDING_EXECUTING (handed out, not started): it looks again at the
    PENDING_EXECUTING timeout instead of giving up for good, so a run its worker never starts,
    requeued QUEUED (attempt 0), is expired then rather than waiting past its TTL for ever."""
    run = await h.engine.trigger(req(h, ttl_s=10))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)  # a worker takes it, then dies
    await h.advance(11)  # the TTL passes while it is handed out: not expired (it may yet start)
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "PENDING_EXECUTING"
    await h.advance(49.5)  # the PENDING_EXECUTING timeout (60 s): back to the queue, never started
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "QUEUED"
    await h.advance(1)  # the TTL job looks again just after that timeout
    row = await h.engine.get_run(run.id)
    assert row is not None and row.status == "EXPIRED", f"{row and row.status} a minute past a TTL of 10 s"
    assert await h.statuses(run.id) == ["QUEUED", "PENDING_EXECUTING", "QUEUED", "FINISHED"]
    assert await h.engine.resources.queue.has_messages([(h.env.env_id, run.id)]) == [False]


async def test_a_requeued_run_whose_ttl_job_was_lost_gets_it_back(h: Harness) -> None:
    """Whatever became of its TTL job while it was handed out, a run requeued without having
    started gets the job back from the reconciler's re-arm of lost jobs."""
    from systems import engine_jobs

    run = await h.engine.trigger(req(h, ttl_s=10))
    await h.engine.dequeue(h.env.worker_group_id, 5)
    await h.engine.resources.jobs.ack(engine_jobs.ttl_id(run.id))  # lost
    await h.advance(61)  # requeued
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "QUEUED"
    assert await h.engine.systems.reconciler.rearm_jobs(0, full=True) >= 1
    await h.advance(1)
    assert (await h.engine.get_run(run.id)).status == "EXPIRED"  # type: ignore[union-attr]


async def test_a_run_started_after_its_ttl_passed_while_handed_out_is_never_expired(h: Harness) -> None:
    """The TTL passes while the run is handed out; its worker then starts it: a TTL job that still
    fires later (re-armed meanwhile, or racing the start's cancel) leaves it and its retries alone."""
    from systems import engine_jobs

    run = await h.engine.trigger(req(h, ttl_s=10))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)
    await h.advance(11)  # the TTL job fires while PENDING_EXECUTING
    s = await h.engine.start_attempt(run.id, d.snapshot.id)
    late = [engine_jobs.ttl(run.id, h.env.env_id, h.clock.now() + 1)]
    await h.engine.resources.change_jobs(schedule=late)  # a job armed again after the start's cancel
    await h.advance(2)
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "EXECUTING"
    out = await h.engine.complete_attempt(run.id, s.snapshot.id, ok=False, error={"type": "E", "message": "x"})
    assert out.action == "retry"
    await h.engine.resources.change_jobs(schedule=[engine_jobs.ttl(run.id, h.env.env_id, h.clock.now() + 1)])
    await h.advance(120)  # queued again for its retry: attempt 1 is never expired
    assert (await h.engine.get_run(run.id)).status == "QUEUED"  # type: ignore[union-attr]


@pytest.mark.parametrize("ttl", [0, "0s", 0.5])
async def test_a_ttl_of_zero_is_no_ttl_not_an_expiry_at_once(h: Harness, ttl: object) -> None:
    """Trigger.dev's SDK and server drop a numeric ttl of 0 (the run has none); here ``ttl: 0``
    (or ``"0s"``, or under a second) expired the run the moment it was queued."""
    from .conftest import api_client

    async with api_client(h) as api:
        answer = await api.post("/api/v1/tasks/hello/trigger", json={"payload": {}, "options": {"ttl": ttl}})
        assert answer.status_code == 200, answer.text
        run_id = answer.json()["id"]
        await h.advance(3600)
        row = await h.engine.get_run(run_id)
        assert row is not None and row.status == "QUEUED" and row.ttl_s is None, f"{row and row.status}"
        shown = (await api.get(f"/api/v3/runs/{run_id}")).json()
        assert shown.get("ttl") is None
        negative = await api.post("/api/v1/tasks/hello/trigger", json={"payload": {}, "options": {"ttl": -1}})
        assert negative.status_code == 400 and "ttl" in negative.text


async def test_a_ttl_is_whole_seconds_and_zero_leaves_the_cap(make_engine) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await make_engine(max_ttl_s=20)
    await h.deploy({"id": "hello"})
    await h.engine.pause_queue(h.env.env_id, "task/hello")
    zero = await h.engine.trigger(req(h, ttl_s=0))  # no TTL of its own: the installation's cap
    fraction = await h.engine.trigger(req(h, ttl_s=5.7))
    assert (await h.engine.get_run(fraction.id)).ttl_s == 5  # type: ignore[union-attr]
    await h.advance(5.2)
    assert (await h.engine.get_run(fraction.id)).status == "EXPIRED"  # type: ignore[union-attr]
    assert (await h.engine.get_run(zero.id)).status == "QUEUED"  # type: ignore[union-attr]
    await h.advance(15)
    assert (await h.engine.get_run(zero.id)).status == "EXPIRED"  # type: ignore[union-attr]
    from run_engine.errors import ValidationError

    with pytest.raises(ValidationError):
        await h.engine.trigger(req(h, ttl_s=-1))


async def test_a_reschedule_racing_the_delay_job_either_moves_the_run_or_is_refused(h: Harness) -> None:
    """Both take the run lock: the run is either enqueued (the reschedule then 422) or rescheduled
    (DELAYED, the job moved), never enqueued with its date moved."""
    for _ in range(5):
        run = await h.engine.trigger(req(h, delay_until=at(h, 5)))
        h.clock.advance(6)
        _, moved = await asyncio.gather(h.engine.run_due_jobs(),
                                        h.engine.reschedule(h.env.env_id, run.id, at(h, 100)), return_exceptions=True)
        status = (await h.engine.latest_snapshot(run.id)).engine_status
        assert (status == "QUEUED") if isinstance(moved, InvalidTransitionError) else (status == "DELAYED"), moved


async def test_a_ttl_racing_a_dequeue_never_leaves_a_run_both_started_and_expired(h: Harness) -> None:
    for _ in range(5):
        run = await h.engine.trigger(req(h, ttl_s=5))
        h.clock.advance(6)
        _, taken = await asyncio.gather(h.engine.run_due_jobs(), h.engine.dequeue(h.env.worker_group_id, 5))
        if taken:  # the dequeue won: handed out, the TTL job looks again later; the start goes through
            (d,) = taken
            await h.engine.start_attempt(run.id, d.snapshot.id)
            assert (await h.engine.get_run(run.id)).status == "EXECUTING"  # type: ignore[union-attr]
        else:
            assert (await h.engine.get_run(run.id)).status == "EXPIRED"  # type: ignore[union-attr]
        assert await h.statuses(run.id) in (["QUEUED", "FINISHED"], ["QUEUED", "PENDING_EXECUTING", "EXECUTING"])


async def test_a_ttl_counts_from_the_engines_clock_at_the_trigger(make_engine) -> None:  # type: ignore[no-untyped-def]
    """The TTL's job is dated by the engine's clock at the trigger; its check read the end from the
    row's created_at, the database's clock, later by the insert's time: the job was put off once
    more (and a test's fake clock, a moment behind the database's under load, saw no expiry:
    test_a_ttl_is_whole_seconds_and_zero_leaves_the_cap failed about once in six runs)."""
    h: Harness = await make_engine()
    await h.deploy({"id": "hello"})
    await h.engine.pause_queue(h.env.env_id, "task/hello")
    h.clock.set(h.clock.now() - 3600)  # the engine's clock an hour behind the database's
    run = await h.engine.trigger(req(h, ttl_s=5))
    await h.advance(4)
    assert (await h.engine.get_run(run.id)).status == "QUEUED"  # type: ignore[union-attr]
    await h.advance(1.5)
    assert (await h.engine.get_run(run.id)).status == "EXPIRED"  # type: ignore[union-attr]
