"""A queue's settings (pause, limits, override, rate limit) live in PostgreSQL and are copied to Redis,
which the dequeue reads: the copy carries the settings' version (migration 0034), Redis keeps the
newest copy it was given, and the reconciler copies again the queues whose copy is behind. What the
API shows is what the dequeue applies, whichever process wrote last and whatever failed between the
two writes (from a review of queue semantics)."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from run_engine.engine import TriggerRequest
from run_engine.run_queue import QueueSettings

from .conftest import Harness

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


def req(h: Harness, task: str = "hello", **kw: Any) -> TriggerRequest:
    return TriggerRequest(env_id=h.env.env_id, task_id=task, **kw)


async def _two_processes(make_engine: Callable[..., Any]) -> tuple[Harness, Harness]:
    """Two engines (two server processes) over the same PostgreSQL and Redis, one environment."""
    a: Harness = await make_engine()
    await a.deploy({"id": "hello"})
    b: Harness = await make_engine()
    return a, dataclasses.replace(b, env=a.env)


def _land_between_read_and_copy(h: Harness, monkeypatch: pytest.MonkeyPatch,
                                action: Callable[[], Awaitable[Any]]) -> None:
    """Run ``action`` (another process's request) right after ``h``'s trigger has read its queue's
    row and before it copies that row to Redis: the interleaving of two server processes."""
    deployments = h.engine.resources.repo.deployments
    ensure = deployments.ensure_queue

    async def ensure_then_other_request(*args: Any, **kwargs: Any) -> Any:
        row = await ensure(*args, **kwargs)
        await action()
        return row

    monkeypatch.setattr(deployments, "ensure_queue", ensure_then_other_request)


async def test_a_pause_is_not_undone_by_a_trigger_of_another_process(
        make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Process B's first trigger of a queue (B just started, or a deploy cleared its cache) upserts
    the queue's row and copies the row it read (not paused) to Redis; an operator's pause answered
    by process A in between was overwritten there: the API said paused, runs kept starting."""
    a, b = await _two_processes(make_engine)
    env = a.env.env_id
    await a.engine.trigger(req(a, queue="shared"))  # the queue exists (A's cache has it)
    _land_between_read_and_copy(b, monkeypatch, lambda: a.engine.pause_queue(env, "shared"))
    run = await b.engine.trigger(req(b, queue="shared"))
    row = await a.engine.task_queue(env, "shared")
    assert row is not None and row.paused  # what GET /api/v1/queues/shared answers
    handed = [d.run.id for d in await a.engine.dequeue(a.env.worker_group_id, 10)]
    assert run.id not in handed, "a run of a paused queue was handed out"
    assert (await a.engine.queue_stats(env, "shared")).paused


async def test_a_lowered_concurrency_override_is_not_undone_by_a_trigger_of_another_process(
        make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The same interleaving with POST /api/v1/queues/{name}/concurrency/override: the operator sets
    0 (stop this queue now); B's stale copy put the old limit (none) back in Redis."""
    a, b = await _two_processes(make_engine)
    env = a.env.env_id
    await a.engine.trigger(req(a, queue="shared"))
    _land_between_read_and_copy(b, monkeypatch, lambda: a.engine.set_queue_concurrency_override(env, "shared", 0))
    await b.engine.trigger(req(b, queue="shared"))
    row = await a.engine.task_queue(env, "shared")
    assert row is not None and row.effective_limit == 0
    handed = await a.engine.dequeue(a.env.worker_group_id, 10)
    assert len(handed) == 0, f"{len(handed)} runs handed out of a queue whose limit is 0"
    # and a reset (a newer change) holds whatever B copies after it
    monkeypatch.undo()
    _land_between_read_and_copy(b, monkeypatch, lambda: a.engine.set_queue_concurrency_override(env, "shared", None))
    b.engine.systems.enqueue.invalidate(env)
    await b.engine.trigger(req(b, queue="shared"))
    assert len(await a.engine.dequeue(a.env.worker_group_id, 10)) == 3


class _RedisAway:
    """In place of the run queue's queue_config script: every call fails as if Redis went away."""

    async def __call__(self, *_: Any) -> Any:
        from redis.exceptions import ConnectionError as RedisConnectionError

        raise RedisConnectionError("Redis went away")

    call_many = __call__


async def test_a_pause_whose_redis_write_failed_is_applied_by_the_reconciler(
        h: Harness, api: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """pause_queue writes PostgreSQL, then Redis. A Redis error between the two left the row paused
    and the queue running (the API reads the row, the dequeue reads Redis), and nothing copied the
    row to Redis again, the reconciler included. The pause answers 503, and the reconciler's pass
    applies what PostgreSQL holds."""
    queue = h.engine.resources.queue
    await h.engine.systems.reconciler.reconcile()  # as in production: the queue's epoch is marked once
    await h.engine.trigger(req(h))  # a run queued (this process has the queue's settings copied already)
    monkeypatch.setattr(queue, "_config", _RedisAway())
    answer = await api.post("/api/v1/queues/task%2Fhello/pause", json={"action": "pause"})
    assert answer.status_code == 503
    monkeypatch.undo()
    report = await h.engine.systems.reconciler.reconcile(full=True)
    shown = (await api.get("/api/v1/queues/task%2Fhello")).json()
    handed = await h.engine.dequeue(h.env.worker_group_id, 5)
    assert not (shown["paused"] and handed), f"shown paused ({shown}), yet {len(handed)} run handed out"
    assert shown["paused"] and (await h.engine.queue_stats(h.env.env_id, "task/hello")).paused
    assert report.settings_repaired >= 1


async def test_a_process_that_died_between_the_two_writes_is_repaired_by_the_next_ordinary_pass(
        h: Harness) -> None:
    """The row changed in PostgreSQL and never copied (the process died): the reconciler's next
    budgeted pass finds it among the queues changed lately, by their version, without a full pass
    or a loss of Redis's data."""
    env = h.env.env_id
    reconciler = h.engine.systems.reconciler
    await reconciler.reconcile()
    await h.engine.trigger(req(h))
    assert await h.engine.resources.repo.deployments.set_queue_paused(env, "task/hello", True) is not None
    assert len(await h.engine.dequeue(h.env.worker_group_id, 5)) == 1  # Redis does not know yet
    await h.engine.trigger(req(h))
    report = await reconciler.reconcile()
    assert await h.engine.dequeue(h.env.worker_group_id, 5) == []
    assert (await h.engine.queue_stats(env, "task/hello")).paused and report.settings_repaired >= 1
    await reconciler.reconcile()
    assert await h.engine.systems.enqueue.stale_queue_rows(await h.engine.list_queues(env)) == []  # in step now


async def test_settings_written_without_a_version_are_put_right_by_the_reconciler(h: Harness) -> None:
    """A process of the version before this one copies settings without their version (its copy of
    an older row may undo a change in Redis): the reconciler's walk over every queue finds a copy
    unlike PostgreSQL's at the version Redis has, and copies the row over it."""
    env = h.env.env_id
    await h.engine.pause_queue(env, "task/hello")
    await h.engine.resources.queue.resume(env, "task/hello")  # an old process's copy of a row read before
    await h.engine.resources.queue.set_queue_limit(env, "limited", 7)
    report = await h.engine.systems.reconciler.reconcile(full=True)
    assert report.settings_repaired >= 2
    hello, limited = (await h.engine.queue_stats(env, "task/hello"), await h.engine.queue_stats(env, "limited"))
    assert hello.paused and limited.limit == 1


async def test_the_version_moves_on_with_every_change_and_only_then(h: Harness) -> None:
    env = h.env.env_id

    async def version(name: str) -> int:
        row = await h.engine.task_queue(env, name)
        assert row is not None
        return row.settings_version

    first = await version("limited")
    assert first > 0
    await h.deploy({"id": "hello"}, {"id": "limited", "queue": "limited"},
                   queues=[{"name": "limited", "concurrencyLimit": 1}], version="2")  # the same settings
    await h.engine.trigger(req(h, "limited"))
    assert await version("limited") == first
    changes: list[Callable[[], Awaitable[Any]]] = [
        lambda: h.engine.pause_queue(env, "limited"), lambda: h.engine.resume_queue(env, "limited"),
        lambda: h.engine.set_queue_concurrency_override(env, "limited", 3),
        lambda: h.deploy({"id": "hello"}, {"id": "limited", "queue": "limited"},
                         queues=[{"name": "limited", "concurrencyLimit": 2, "rateLimit": {"limit": 5}}], version="3"),
        lambda: h.engine.trigger(req(h, "limited", queue="limited", queue_concurrency_limit=4)),
    ]
    seen = [first]
    for change in changes:
        await change()
        seen.append(await version("limited"))
    assert seen == sorted(set(seen)), f"versions {seen}"
    queue = await h.engine.queue_stats(env, "limited")
    assert (queue.limit, queue.paused) == (3, False)  # the override over the deployed 4


async def test_the_run_queue_keeps_the_newest_copy_of_a_queues_settings(h: Harness) -> None:
    queue, env = h.engine.resources.queue, h.env.env_id
    assert await queue.configure_queues([QueueSettings(env, "v", limit=5, paused=True, version=20)]) == [True]
    # older: ignored; the same version: ignored but for a repair; newer: set
    assert await queue.configure_queues([QueueSettings(env, "v", limit=1, version=19)]) == [False]
    assert await queue.configure_queues([QueueSettings(env, "v", limit=2, version=20)]) == [False]
    stats = await queue.queue_stats(env, "v")
    assert (stats.limit, stats.paused) == (5, True)
    assert await queue.stale_settings([QueueSettings(env, "v", limit=5, paused=True, version=20),
                                       QueueSettings(env, "v", limit=2, version=20),
                                       QueueSettings(env, "v", limit=2, version=19),
                                       QueueSettings(env, "v", limit=2, version=21),
                                       QueueSettings(env, "never-copied", version=1)]) == [
        False, True, False, True, True]
    assert await queue.configure_queues([QueueSettings(env, "v", limit=2, version=20)], repair=True) == [True]
    assert await queue.configure_queues([QueueSettings(env, "v", limit=3, version=1_800_000_000_000_001)]) == [True]
    stats = await queue.queue_stats(env, "v")
    assert (stats.limit, stats.paused) == (3, False)
    assert await queue.configure_queues([QueueSettings(env, "v", limit=4, version=1_800_000_000_000_000)]) == [False]


async def test_a_rate_limit_copied_by_the_version_before_is_copied_again_in_microseconds(h: Harness) -> None:
    """A queue's rate limit written by a process of the version before has only its fields in whole
    ms (rounded down: 600 a second was 1,000): the reconciler's walk finds it unlike PostgreSQL's and
    copies it with its µs fields."""
    env, queue = h.env.env_id, h.engine.resources.queue
    await h.deploy({"id": "hello"}, {"id": "limited", "queue": "limited"},
                   queues=[{"name": "limited", "concurrencyLimit": 1, "rateLimit": {"limit": 600}}], version="2")
    meta = f"{queue.keys.queue(env, 'limited')}:meta"
    assert await h.engine.redis.hmget(meta, "rate_t", "rate_t_us") == [b"1", b"1667"]
    await h.engine.redis.hdel(meta, "rate_t_us", "rate_tau_us", "tat_us")
    await h.engine.redis.hset(meta, "tat", 1_900_000_000_000)  # where that version's dequeues got to
    await h.engine.systems.reconciler.reconcile(full=True)
    assert await h.engine.redis.hmget(meta, "rate_t", "rate_t_us", "rate_tau_us", "tat") == [
        b"1", b"1667", b"0", b"1900000000000"]  # the same rate: its arrival time kept


@pytest.mark.parametrize("value", [True, False])
async def test_true_or_false_is_refused_as_a_queues_limit_not_read_as_one_or_zero(
        h: Harness, api: Any, value: bool) -> None:
    """A hostile review of the queue endpoints sent ``concurrencyLimit: true``: pydantic read it as 1
    (false as 0: the queue stopped) and answered 200. A limit is a number: true and false are 400,
    over the API's override, a trigger's queue option (its limit and rate limit) alike, and nothing
    changes."""
    queue = "/api/v1/queues/limited"
    sent = [(f"{queue}/concurrency/override", {"concurrencyLimit": value}),
            ("/api/v1/tasks/limited/trigger", {"payload": {}, "options": {
                "queue": {"name": "limited", "concurrencyLimit": value}}}),
            ("/api/v1/tasks/limited/trigger", {"payload": {}, "options": {
                "queue": {"name": "limited", "rateLimit": {"limit": value, "period": "1s"}}}}),
            ("/api/v1/tasks/limited/trigger", {"payload": {}, "options": {
                "queue": {"name": "limited", "rateLimit": {"limit": 5, "burst": value}}}})]
    for path, body in sent:
        r = await api.post(path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        error = r.json()["error"]
        assert error["code"] == "invalid_input" and "true or false" in error["message"], error
    shown = (await api.get(queue)).json()
    assert (shown["concurrencyLimit"], shown["concurrencyLimitOverridden"], shown["rateLimit"]) == (1, False, None)
    assert (await api.post(f"{queue}/concurrency/override", json={"concurrencyLimit": 2.0})).json()[
        "concurrencyLimit"] == 2  # a whole number written as a float is still one
