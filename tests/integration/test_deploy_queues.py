"""A worker's connect registers its deployment's queues within the environment's queue cap
(RUN_ENGINE_MAX_QUEUES_PER_ENV, as a trigger naming a new queue is), writes to the run queue the
settings of its own queues only (not every queue of the environment), and two connects of one
environment at once both succeed (no 500)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from run_engine.engine import TriggerRequest

from .conftest import Harness, api_client

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)

CONNECT = "/engine/v1/worker-actions/connect"


def connect_body(version: str, *queues: dict[str, Any], tasks: tuple[str, ...] = ("hello",)) -> dict[str, Any]:
    return {"workerInstanceName": f"w-{version}",
            "deployment": {"version": version, "tasks": [{"id": t} for t in tasks], "queues": list(queues)}}


async def test_a_connect_past_the_queue_cap_is_refused_with_nothing_written(make_engine: Callable[..., Any]) -> None:
    h: Harness = await make_engine(max_queues_per_env=5)
    first = await h.deploy({"id": "hello"})  # its own queue, task/hello: one of the five
    async with api_client(h, h.env.worker_group_token) as worker:
        too_many = await worker.post(CONNECT, json=connect_body("2", *({"name": f"q{i}"} for i in range(5))))
        assert too_many.status_code == 422, too_many.text
        error = too_many.json()["error"]
        assert error["code"] == "too_many_queues"
        assert "5" in error["message"] and "RUN_ENGINE_MAX_QUEUES_PER_ENV" in error["message"]
        # nothing of it was written: no queue, and the current deployment is the one before
        assert [q.name for q in await h.engine.list_queues(h.env.env_id)] == ["task/hello"]
        current = await h.engine.resources.repo.deployments.current_task(h.env.env_id, h.env.worker_group_id,
                                                                         "hello")
        assert current is not None and current.deployment_id == first
        # nor a worker instance: the group's listing showed one that never served
        assert not [i for g in await h.engine.workers(h.env.env_id) for i in g.instances if i["name"].endswith("w-2")]

        fits = await worker.post(CONNECT, json=connect_body("3", *({"name": f"q{i}"} for i in range(4))))
        assert fits.status_code == 200, fits.text  # task/hello is there already: 4 new make 5
        # a full environment takes its own queues again (new limits too), not one more
        again = await worker.post(CONNECT, json=connect_body("4", {"name": "q0", "concurrencyLimit": 2}))
        assert again.status_code == 200, again.text
        assert (await h.engine.queue_stats(h.env.env_id, "q0")).limit == 2
        one_more = await worker.post(CONNECT, json=connect_body("5", {"name": "q0"}, {"name": "one-more"}))
        assert one_more.status_code == 422 and one_more.json()["error"]["code"] == "too_many_queues"
    assert len(await h.engine.list_queues(h.env.env_id)) == 5


async def test_an_environment_at_its_cap_keeps_its_deployment_and_the_others_take_the_new_one(
        make_engine: Callable[..., Any], unique: str) -> None:
    """One environment of the group full of its triggers' custom queues does not stop a new version
    in the others: it is answered as refused and keeps its current deployment."""
    from run_engine.tenancy import ensure_environment

    h: Harness = await make_engine(max_queues_per_env=5)
    prod = await ensure_environment(h.engine.resources.repo, secret="test-secret", org=f"org-{unique}",
                                    project="proj", env="prod")
    assert prod.worker_group_id == h.env.worker_group_id
    async with api_client(h, h.env.worker_group_token) as worker:
        first = await worker.post(CONNECT, json=connect_body("1"))
        assert first.status_code == 200, first.text
        for i in range(4):  # dev's key holder names four custom queues: dev is at its cap of five
            await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", queue=f"scratch{i}"))
        second = await worker.post(CONNECT, json=connect_body("2", tasks=("hello", "new")))
        assert second.status_code == 200, second.text
        answer = second.json()
        assert [d["environmentId"] for d in answer["deployments"]] == [prod.env_id]
        assert [(r["environmentId"], r["error"]["code"]) for r in answer["refused"]] == [
            (h.env.env_id, "too_many_queues")]
        repo = h.engine.resources.repo.deployments
        dev_current = await repo.current_task(h.env.env_id, h.env.worker_group_id, "hello")
        prod_current = await repo.current_task(prod.env_id, prod.worker_group_id, "new")
        dev_first = {d["environmentId"]: d["deploymentId"] for d in first.json()["deployments"]}[h.env.env_id]
        assert dev_current is not None and dev_current.deployment_id == dev_first  # kept the version before
        assert prod_current is not None and prod_current.deployment_id == answer["deployments"][0]["deploymentId"]
        for i in range(3):  # prod at its cap too (task/hello, task/new): refused everywhere, the connect is
            await h.engine.trigger(TriggerRequest(env_id=prod.env_id, task_id="hello", queue=f"scratch{i}"))
        third = await worker.post(CONNECT, json=connect_body("3", tasks=("hello", "newer")))
        assert third.status_code == 422 and third.json()["error"]["code"] == "too_many_queues"


async def test_a_connect_sets_in_the_run_queue_only_the_queues_it_declares(h: Harness) -> None:
    env = h.env.env_id
    await h.engine.trigger(TriggerRequest(env_id=env, task_id="hello", queue="other", queue_concurrency_limit=3))
    # a mark in the run queue's copy of another queue's settings: a connect that rewrote every
    # queue of the environment would put back 3
    await h.engine.resources.queue.set_queue_limit(env, "other", 99)
    await h.engine.pause_queue(env, "limited")
    await h.deploy({"id": "hello"}, {"id": "limited", "queue": "limited"},
                   queues=[{"name": "limited", "concurrencyLimit": 2}], version="2")
    assert (await h.engine.queue_stats(env, "other")).limit == 99
    limited = await h.engine.queue_stats(env, "limited")
    assert limited.limit == 2 and limited.paused  # its new limit; its pause kept


async def test_queue_settings_are_set_in_one_call(h: Harness) -> None:
    from run_engine.run_queue import QueueSettings, RateLimit

    queue, env = h.engine.resources.queue, h.env.env_id
    await queue.configure_queues([QueueSettings(env, "a", 3, 2, RateLimit(10, 1000, 2), paused=True),
                                  QueueSettings(env, "b", limit=7)])
    a, b = await queue.queue_stats(env, "a"), await queue.queue_stats(env, "b")
    assert (a.limit, a.key_limit, a.paused) == (3, 2, True) and (b.limit, b.key_limit, b.paused) == (7, None, False)
    await queue.configure_queues([QueueSettings(env, "a")])  # back to no limits, resumed
    a = await queue.queue_stats(env, "a")
    assert (a.limit, a.key_limit, a.paused) == (None, None, False)


async def test_two_connects_of_one_environment_at_once_both_succeed(h: Harness, database_url: str) -> None:
    """Both get past their checks before either writes (a transaction holds the current
    deployment's row until both wait): neither answers 500, and one of them is current."""
    async with await psycopg.AsyncConnection.connect(database_url) as gate, \
            api_client(h, h.env.worker_group_token) as worker:
        async with gate.transaction():
            await gate.execute("SELECT 1 FROM deployment WHERE environment_id = %s AND is_current FOR UPDATE",
                               (h.env.env_id,))
            connects = [asyncio.ensure_future(worker.post(CONNECT, json=connect_body(v, tasks=("hello", v))))
                        for v in ("a", "b")]
            waiting = 0
            while waiting < 2 and not any(c.done() for c in connects):  # the test's timeout bounds it
                await asyncio.sleep(0.01)
                row = await (await gate.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock'")).fetchone()
                waiting = row[0] if row else 0
            assert waiting == 2 and not any(c.done() for c in connects)
        answers = await asyncio.gather(*connects)
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
        made = {a.json()["deploymentId"] for a in answers}
        current = await (await gate.execute(
            "SELECT id FROM deployment WHERE environment_id = %s AND is_current", (h.env.env_id,))).fetchall()
        assert len(current) == 1 and current[0][0] in made
