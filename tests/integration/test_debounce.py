"""Debounce (systems/debounce.py) on real PostgreSQL and Redis with a fake clock: the join moves the
run's date and its delay job, the default cap, the race between the delay job and a joining
trigger, concurrent first triggers on two engines, what trailing mode replaces."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from run_engine.engine import Debounce, TriggerRequest
from run_engine.errors import ValidationError
from run_engine.statuses import RunStatus
from systems.debounce import DEFAULT_MAX_DELAY_S

from .conftest import Harness

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


def req(h: Harness, key: str, delay_s: float = 10, task: str = "hello", mode: str = "leading",
        max_delay_s: float | None = None, **kw: Any) -> TriggerRequest:
    return TriggerRequest(env_id=h.env.env_id, task_id=task, debounce=Debounce(key, delay_s, mode, max_delay_s),
                          **kw)


def new_key() -> str:
    return uuid.uuid4().hex


async def status(h: Harness, run_id: str) -> str:
    return (await h.engine.latest_snapshot(run_id)).engine_status


async def test_a_join_moves_the_date_and_the_delay_job(h: Harness) -> None:
    key = new_key()
    first = await h.engine.trigger(req(h, key, payload={"n": 1}))
    assert first.status == RunStatus.DELAYED and not first.is_cached
    await h.advance(8)
    again = await h.engine.trigger(req(h, key, payload={"n": 2}))
    assert again.id == first.id and again.is_cached
    await h.advance(5)  # past the first date (10), before the new one (18)
    assert await status(h, first.id) == "DELAYED"
    await h.advance(5.5)
    assert await status(h, first.id) == "QUEUED"
    row = await h.engine.get_run(first.id)
    assert row is not None and row.payload == {"n": 1}  # leading: the first payload
    assert await h.statuses(first.id) == ["DELAYED", "QUEUED"]  # a join appends no snapshot
    after = await h.engine.trigger(req(h, key))
    assert after.id != first.id and not after.is_cached  # the key is free again


async def test_without_max_delay_the_default_cap_holds(h: Harness) -> None:
    key = new_key()
    first = await h.engine.trigger(req(h, key, delay_s=600))
    start = h.clock.now()
    for _ in range(10):
        await h.advance(500)
        if (await h.engine.trigger(req(h, key, delay_s=600))).id != first.id:
            break
    row = await h.engine.get_run(first.id)
    assert row is not None and row.delay_until is not None
    assert row.delay_until.timestamp() == pytest.approx(start + DEFAULT_MAX_DELAY_S, abs=0.01)
    await h.advance(start + DEFAULT_MAX_DELAY_S + 1 - h.clock.now())
    assert await status(h, first.id) == "QUEUED"


async def test_trailing_replaces_payload_metadata_tags_and_options_leading_keeps_them(h: Harness) -> None:
    key = new_key()
    first = await h.engine.trigger(req(h, key, mode="trailing", payload={"n": 1}, tags=("a",), metadata={"m": 1},
                                       max_attempts=2))
    await h.engine.trigger(req(h, key, mode="trailing", payload={"n": 2}, tags=("b", "c"), metadata={"m": 2},
                               max_attempts=5, machine="small-2x", max_duration_s=30))
    await h.engine.trigger(req(h, key, mode="trailing", payload=None))  # keeps what it does not give
    row = await h.engine.get_run(first.id)
    assert row is not None
    assert (row.payload, row.tags, row.metadata, row.max_attempts, row.machine, row.max_duration_s) == (
        None, ["b", "c"], {"m": 2}, 5, "small-2x", 30)
    await h.engine.trigger(req(h, key, mode="leading", payload={"n": 4}, tags=("z",)))
    row = await h.engine.get_run(first.id)
    assert row is not None and row.payload is None and row.tags == ["b", "c"]


async def test_the_delay_job_and_a_joining_trigger_never_both_win(h: Harness) -> None:
    """The job fires (the run is due) while a trigger joins: either the trigger joined first (the run
    stays DELAYED with its new date, the job leaves it) or the job enqueued it first (the trigger
    makes a new run); never a join whose run is enqueued anyway."""
    outcomes = set()

    async def job_after(run_id: str, wait_s: float) -> None:
        await asyncio.sleep(wait_s)  # spreads the job over the trigger's steps: not a timing assertion
        await h.engine.systems.delayed_runs.enqueue_delayed(run_id)

    for i in range(16):
        key = new_key()
        first = await h.engine.trigger(req(h, key, delay_s=5))
        h.clock.advance(6)  # due; the job is not run by advance here, but by job_after below
        joined, _ = await asyncio.gather(h.engine.trigger(req(h, key, delay_s=5)), job_after(first.id, i * 0.0005))
        if joined.id == first.id:
            assert await status(h, first.id) == "DELAYED"
            outcomes.add("joined")
        else:
            assert await status(h, first.id) == "QUEUED"
            assert await status(h, joined.id) == "DELAYED"
            outcomes.add("new run")
    assert outcomes  # whichever order the two took, each run was in one consistent state


async def test_a_trigger_arriving_while_the_delay_job_enqueues_makes_a_new_run(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job has read the run (DELAYED, due) and is about to write QUEUED when a trigger with the
    key arrives: the trigger must not join a run that is being enqueued (it waits for the run lock,
    then finds it QUEUED and creates a new run)."""
    key = new_key()
    first = await h.engine.trigger(req(h, key, delay_s=5))
    h.clock.advance(6)
    inside = asyncio.Event()
    snapshots = h.engine.systems.delayed_runs.execution_snapshot
    apply = snapshots.apply

    async def slow_apply(*args: Any, **kwargs: Any) -> Any:
        inside.set()
        await asyncio.sleep(0.2)  # widens the window a join without the lock would slip into
        return await apply(*args, **kwargs)

    monkeypatch.setattr(snapshots, "apply", slow_apply)
    job = asyncio.create_task(h.engine.systems.delayed_runs.enqueue_delayed(first.id))
    await inside.wait()
    second = await h.engine.trigger(req(h, key, delay_s=5))
    await job
    assert second.id != first.id and not second.is_cached
    assert await status(h, first.id) == "QUEUED"
    assert await status(h, second.id) == "DELAYED"


async def test_concurrent_first_triggers_on_two_engines_make_one_run(make_engine: Callable[..., Any]) -> None:
    a: Harness = await make_engine()
    b: Harness = await make_engine()
    b = dataclasses.replace(b, env=a.env)
    key = new_key()
    results = await asyncio.gather(*(h.engine.trigger(req(h, key, mode="trailing", payload={"i": i}))
                                     for i, h in enumerate([a, b] * 15)))
    assert len({r.id for r in results}) == 1
    assert sorted(r.is_cached for r in results) == [False] + [True] * 29
    runs = await a.engine.list_runs(a.env.env_id, tasks=["hello"], statuses=["DELAYED"])
    assert [r.id for r in runs] == [results[0].id]  # a fresh environment: this key's run only


async def test_an_idempotency_key_wins_over_the_debounce_key(h: Harness) -> None:
    first = await h.engine.trigger(req(h, new_key(), idempotency_key="same"))
    again = await h.engine.trigger(req(h, new_key(), idempotency_key="same"))
    assert again.id == first.id and again.is_cached


async def test_the_engine_refuses_what_the_api_would(h: Harness) -> None:
    for bad, field in ((req(h, ""), "debounce.key"), (req(h, "k" * 513), "debounce.key"),
                       (req(h, "k", delay_s=0.5), "debounce.delay"), (req(h, "k", mode="x"), "debounce.mode"),
                       (req(h, "k", delay_s=10, max_delay_s=5), "debounce.maxDelay")):
        with pytest.raises(ValidationError) as caught:
            await h.engine.trigger(bad)
        assert caught.value.field == field
    with pytest.raises(ValidationError):  # trigger-and-wait goes straight to EnqueueSystem: no debounce
        await h.engine.systems.enqueue.trigger_many([req(h, "k")])


async def test_a_plain_trigger_reads_nothing_for_debounce(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*_: Any, **__: Any) -> Any:
        raise AssertionError("a plain trigger looked up debounce state")

    monkeypatch.setattr(h.engine.resources.repo.runs, "delayed_run_by_debounce_key", forbidden)
    monkeypatch.setattr(h.engine.systems.debounce, "trigger", forbidden)
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    assert run.status == RunStatus.QUEUED
    batch = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello")] * 3)
    assert len({r.id for r in batch}) == 3


async def test_changes_without_a_new_state_are_events_for_realtime(h: Harness) -> None:
    """A joined trigger, new metadata, new tags and a new date change what a subscriber sees without
    a snapshot: each emits run_updated (RealtimeHub wakes the run's watchers on it)."""
    seen: list[tuple[str, str, str]] = []
    undo = h.engine.events.subscribe("run_updated", lambda e: seen.append((e.run_id, e.env_id, e.data["what"])))
    try:
        key = new_key()
        first = await h.engine.trigger(req(h, key, payload={"n": 1}))
        assert seen == []  # creating it is run_created, not an update
        await h.engine.trigger(req(h, key, mode="trailing", payload={"n": 2}))
        await h.engine.set_metadata(h.env.env_id, first.id, {"progress": 0.5})
        assert await h.engine.add_tags(h.env.env_id, first.id, ["t"], 10) == ["t"]
        assert await h.engine.add_tags(h.env.env_id, first.id, [f"x{i}" for i in range(20)], 10) is None
        await h.engine.reschedule(h.env.env_id, first.id, datetime.fromtimestamp(h.clock.now() + 100, UTC))
        assert seen == [(first.id, h.env.env_id, what) for what in ("debounced", "metadata", "tags", "delay")]
    finally:
        undo()


async def test_a_batch_refused_for_its_last_item_creates_none(h: Any, api: Any) -> None:
    """A plain item and a debounced one naming a worker group that does not exist: 400, and no
    run (the plain one was stored first, so a client retrying the fixed batch got it twice)."""
    made = await api.post("/api/v1/tasks/batch", json={"items": [
        {"task": "hello", "payload": {"i": 0}},
        {"task": "hello", "payload": {"i": 1}, "options": {"debounce": {"key": "x", "delay": "5s"},
                                                           "workerGroup": "nope"}}]})
    assert made.status_code == 400, made.text
    assert await h.engine.list_runs(h.env.env_id, tasks=["hello"], limit=10) == []


async def test_an_idempotency_key_with_a_ttl_of_zero_is_not_kept(h: Any) -> None:
    first = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", idempotency_key="k0",
                                                  idempotency_key_ttl_s=0))
    h.clock.advance(1)
    second = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", idempotency_key="k0",
                                                   idempotency_key_ttl_s=0))
    assert second.id != first.id and not second.is_cached


async def test_a_batch_whose_debounced_item_names_a_queue_past_the_cap_creates_nothing(
        make_engine: Callable[..., Any]) -> None:
    """Every item is checked before any run is created, its queue's room too: before, the plain
    items were committed and the request answered 422, and the corrected retry made them again."""
    from .conftest import api_client

    h = await make_engine(max_queues_per_env=2)
    await h.deploy({"id": "hello"})  # its queue task/hello is one of the two
    async with api_client(h) as api:
        body = {"items": [{"task": "hello", "payload": {"n": 1}},
                          {"task": "hello", "payload": {"n": 2},
                           "options": {"queue": "fresh", "debounce": {"key": "k", "delay": "10s"}}},
                          {"task": "hello", "payload": {"n": 3},
                           "options": {"queue": "fresher", "debounce": {"key": "j", "delay": "10s"}}}]}
        refused = await api.post("/api/v1/tasks/batch", json=body)
        assert refused.status_code == 422 and refused.json()["error"]["code"] == "too_many_queues"
        assert await h.engine.list_runs(h.env.env_id, tasks=["hello"], limit=100, light=True) == []


async def test_one_key_in_two_tasks_or_two_environments_makes_a_run_each(h: Harness) -> None:
    """The key is (environment, task, key): the same key elsewhere never joins another's run."""
    from run_engine.tenancy import ensure_environment

    other = await ensure_environment(h.engine.resources.repo, secret="test-secret", org=h.env.org_id,
                                     project="other-proj", env="prod")
    key = new_key()
    runs = [await h.engine.trigger(req(h, key)), await h.engine.trigger(req(h, key, task="limited")),
            await h.engine.trigger(dataclasses.replace(req(h, key), env_id=other.env_id))]
    assert len({r.id for r in runs}) == 3 and not any(r.is_cached for r in runs)
