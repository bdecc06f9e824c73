"""Explain: the right reason, with its numbers, for every way a run can wait to start."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from run_engine.api.serialize import explanation_object
from run_engine.engine import TriggerRequest
from run_engine.run_queue import RateLimit

from .conftest import Harness

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


def req(h: Harness, task: str = "hello", **kw: object) -> TriggerRequest:
    return TriggerRequest(env_id=h.env.env_id, task_id=task, **kw)  # type: ignore[arg-type]


async def codes(h: Harness, run_id: str) -> list[dict]:  # type: ignore[type-arg]
    out = explanation_object(await h.engine.explain(h.env.env_id, run_id))
    assert out["summary"] == out["reasons"][0]["message"]
    return out["reasons"]


async def start_one(h: Harness, task: str = "hello", **kw: object) -> str:
    run = await h.engine.trigger(req(h, task, **kw))
    got = await h.engine.dequeue(h.env.worker_group_id, 5)
    (d,) = [g for g in got if g.run.id == run.id]
    await h.engine.start_attempt(run.id, d.snapshot.id)
    return run.id


async def test_delayed_pending_version_paused_and_ready(h: Harness) -> None:
    delayed = await h.engine.trigger(req(h, delay_until=datetime.fromtimestamp(h.clock.now() + 60, UTC)))
    (r,) = await codes(h, delayed.id)
    assert r["code"] == "DELAYED" and r["until"]
    nobody = await h.engine.trigger(req(h, "no-such-deployed-task"))
    (r,) = await codes(h, nobody.id)
    assert r["code"] == "WAITING_FOR_DEPLOYMENT" and r["task"] == "no-such-deployed-task"
    first = await h.engine.trigger(req(h))
    second = await h.engine.trigger(req(h))
    (r,) = await codes(h, second.id)
    assert r["code"] == "READY" and r["ahead"] == 1
    await h.engine.pause_queue(h.env.env_id, "task/hello")
    assert [x["code"] for x in await codes(h, first.id)] == ["QUEUE_PAUSED"]
    await h.engine.resume_queue(h.env.env_id, "task/hello")
    running = await start_one(h)
    (r,) = await codes(h, running)
    assert r["code"] == "NOT_WAITING_TO_START" and "EXECUTING" in r["message"]


async def test_limits_with_their_numbers(h: Harness) -> None:
    await start_one(h, "limited")
    waiting = await h.engine.trigger(req(h, "limited"))
    (r,) = await codes(h, waiting.id)
    assert (r["code"], r["running"], r["limit"], r["queue"]) == ("QUEUE_AT_LIMIT", 1, 1, "limited")
    await h.engine.resources.queue.set_env_limit(h.env.env_id, 1)
    other = await h.engine.trigger(req(h))
    assert {"code": "ENV_AT_LIMIT", "running": 1, "limit": 1}.items() <= (await codes(h, other.id))[0].items()
    await h.engine.resources.queue.set_env_limit(h.env.env_id, 100)
    await h.engine.resources.queue.set_key_limit(h.env.env_id, "task/hello", 1)
    await start_one(h, concurrency_key="tenant-a")
    keyed = await h.engine.trigger(req(h, concurrency_key="tenant-a"))
    found = {x["code"]: x for x in await codes(h, keyed.id)}
    assert found["KEY_AT_LIMIT"]["concurrencyKey"] == "tenant-a" and found["KEY_AT_LIMIT"]["limit"] == 1


async def test_rate_limit_and_back_off(h: Harness) -> None:
    first = await h.engine.trigger(req(h))  # (its queue is mirrored from PostgreSQL on first use)
    await h.engine.resources.queue.set_rate_limit(h.env.env_id, "task/hello", RateLimit(1, 60_000))
    assert [d.run.id for d in await h.engine.dequeue(h.env.worker_group_id, 5)] == [first.id]
    later = await h.engine.trigger(req(h))
    (r,) = await codes(h, later.id)
    assert r["code"] == "RATE_LIMITED" and r["until"]
    await h.engine.resources.queue.set_rate_limit(h.env.env_id, "task/hello", None)
    await h.engine.cancel(later.id)
    failing = await h.engine.trigger(req(h, "limited"))
    (d,) = [g for g in await h.engine.dequeue(h.env.worker_group_id, 5) if g.run.id == failing.id]
    s = await h.engine.start_attempt(failing.id, d.snapshot.id)
    await h.engine.complete_attempt(failing.id, s.snapshot.id, ok=False, error={"type": "E", "message": "x"})
    (r,) = await codes(h, failing.id)
    assert r["code"] == "NOT_DUE" and "back-off" in r["message"]


async def test_a_rate_limit_removed_by_the_version_before_is_no_reason(h: Harness) -> None:
    """A rolling upgrade: a process of the version before removes a rate limit by its fields in ms
    alone; the µs fields this version wrote beside them hold no more (lua/queue_lib.lua)."""
    queue = h.engine.resources.queue
    first = await h.engine.trigger(req(h))
    await queue.set_rate_limit(h.env.env_id, "task/hello", RateLimit(1, 60_000))
    assert [d.run.id for d in await h.engine.dequeue(h.env.worker_group_id, 5)] == [first.id]
    later = await h.engine.trigger(req(h))
    assert [r["code"] for r in await codes(h, later.id)] == ["RATE_LIMITED"]
    await h.engine.redis.hdel(f"{queue.keys.queue(h.env.env_id, 'task/hello')}:meta", "rate_t", "rate_tau", "tat")
    assert [r["code"] for r in await codes(h, later.id)] == ["READY"]
