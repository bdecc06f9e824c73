"""One tenant's bad item never fails the others grouped with it (issue 10): group commits split
on failure, and a run that is stored is answered as created even when the queue refused it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from run_engine.engine import TriggerRequest
from run_engine.ids import new_id

from .conftest import Harness

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


async def test_a_row_postgresql_refuses_fails_only_its_own_trigger(h: Harness) -> None:
    good = [TriggerRequest(env_id=h.env.env_id, task_id="hello", payload={"i": i}) for i in range(20)]
    bad = TriggerRequest(env_id=h.env.env_id, task_id="hello", payload={"x": "nul\x00"})  # past the API's checks
    results = await asyncio.gather(*(h.engine.trigger(r) for r in [*good[:10], bad, *good[10:]]),
                                   return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert len(failed) == 1 and results[10] is failed[0]
    created = [r for r in results if not isinstance(r, BaseException)]
    assert len(created) == 20
    for run in created:
        row = await h.engine.get_run(run.id)
        assert row is not None and row.status == "QUEUED"
    states = await h.engine.resources.queue.message_states([(h.env.env_id, r.id) for r in created])
    assert states == ["ready"] * 20


async def test_a_poisoned_enqueue_fails_nobody_and_the_reconciler_enqueues_the_run(h: Harness) -> None:
    queue = h.engine.resources.queue
    poisoned = new_id("run")
    # the run's message key already holds a string: the enqueue script fails on that run only
    await queue.redis.set(queue.keys.message(h.env.env_id, poisoned), "not a hash")
    requests = [TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=i) for i in range(20)]
    requests.insert(7, TriggerRequest(env_id=h.env.env_id, task_id="hello", payload="p", run_id=poisoned))
    results = await asyncio.gather(*(h.engine.trigger(r) for r in requests))
    assert [r.id for r in results][7] == poisoned  # answered as created: it is stored
    others = [r.id for r in results if r.id != poisoned]
    assert await queue.message_states([(h.env.env_id, r) for r in others]) == ["ready"] * 20
    row = await h.engine.get_run(poisoned)
    assert row is not None and row.status == "QUEUED"

    # the same in one Lua call: the grouped call fails, is split, and the others land
    flushes: list[int] = []
    enqueue = queue.enqueue

    async def counting(items: Any, now_ms: int) -> None:
        flushes.append(len(items))
        await enqueue(items, now_ms)

    queue.enqueue = counting  # type: ignore[method-assign]
    items = [h.engine.systems.enqueue.item_for(row, reset_deliveries=True)]
    items += [h.engine.systems.enqueue.item_for(r) for r in [await h.engine.get_run(i) for i in others] if r]
    outcome = await asyncio.gather(*(h.engine.resources.enqueues.submit(i) for i in items), return_exceptions=True)
    queue.enqueue = enqueue  # type: ignore[method-assign]
    assert flushes[0] == 21 and len(flushes) > 1
    assert isinstance(outcome[0], Exception) and outcome[1:] == [None] * 20

    await queue.redis.delete(queue.keys.message(h.env.env_id, poisoned))
    report = await h.engine.systems.reconciler.reconcile(grace_s=0, full=True)
    assert report.requeued_missing >= 1
    assert await queue.message_states([(h.env.env_id, poisoned)]) == ["ready"]


@pytest.mark.parametrize("failing_step", ["jobs", "enqueue"])
async def test_a_redis_failure_after_the_insert_still_answers_with_the_run(
        make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, failing_step: str) -> None:
    h: Harness = await make_engine()
    await h.deploy({"id": "hello"})

    async def down(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("redis is down")

    target = h.engine.resources.jobs if failing_step == "jobs" else h.engine.resources.queue
    monkeypatch.setattr(target, "apply" if failing_step == "jobs" else "enqueue", down)
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", ttl_s=60))
    row = await h.engine.get_run(run.id)
    assert row is not None and row.status == "QUEUED"  # stored: a retrying client would duplicate it


async def test_the_trigger_caches_do_not_grow_with_what_tenants_send(h: Harness,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    enqueue = h.engine.systems.enqueue
    monkeypatch.setattr(type(enqueue), "CACHE_SIZE", 5)
    for i in range(20):
        await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id=f"random-task-{i}"))
    assert len(enqueue._tasks) <= 5 and len(enqueue._queues) <= 5
    assert ("random-task-19" in {k[2] for k in enqueue._tasks})  # the newest entries stay


async def test_the_reconciler_repairs_lost_runs_and_survives_one_it_cannot_repair(h: Harness) -> None:
    queue = h.engine.resources.queue
    a = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", payload="a"))
    b = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", payload="b"))
    wg = h.env.worker_group_id
    for run in (a, b):  # taken out of their ready set, as a script that failed half-way would leave them
        await queue.redis.zrem(queue.keys.ready(h.env.env_id, wg, run.queue, None), run.id)
    assert await queue.placements([(h.env.env_id, a.id), (h.env.env_id, b.id)]) == ["lost", "lost"]
    await queue.redis.delete(queue.keys.message(h.env.env_id, a.id))
    await queue.redis.set(queue.keys.message(h.env.env_id, a.id), "broken")  # a cannot be enqueued
    report = await h.engine.systems.reconciler.reconcile(grace_s=0, full=True)
    assert report.requeued_stuck >= 1
    assert await queue.placements([(h.env.env_id, b.id)]) == ["ready"]
    got = await h.engine.dequeue(wg, 10)
    assert b.id in {d.run.id for d in got}


async def test_an_environment_may_have_so_many_queues(make_engine: Callable[..., Any]) -> None:
    """Each queue is a row, Redis keys and settings that every deploy and every restore of Redis
    walks: a tenant naming a new queue per trigger is refused past RUN_ENGINE_MAX_QUEUES_PER_ENV
    (422 too_many_queues), while its queues go on and another environment's are not counted."""
    from run_engine.errors import UnprocessableError
    from run_engine.tenancy import ensure_environment

    h: Harness = await make_engine(max_queues_per_env=5)
    await h.deploy({"id": "hello"})  # its own queue, task/hello: one of the five
    for i in range(4):
        await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", queue=f"q{i}"))
    with pytest.raises(UnprocessableError) as refused:
        await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", queue="one-more"))
    assert refused.value.code == "too_many_queues"
    assert (await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", queue="q3",
                                                  queue_concurrency_limit=2))).status == "QUEUED"
    assert (await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))).status == "QUEUED"
    other = await ensure_environment(h.engine.resources.repo, secret="test-secret", org="org-other-queues",
                                     project="p", env="dev")
    made = await h.engine.trigger(TriggerRequest(env_id=other.env_id, task_id="hello", queue="one-more"))
    assert made.queue == "one-more"
