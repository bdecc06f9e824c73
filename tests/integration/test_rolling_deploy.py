"""Workers only get runs of tasks their deployment has (issue 11): an old worker gives a new
task's run back, undone and in its place, for another worker; a run of a task that the current
deployment lacks waits as PENDING_VERSION until a deployment with it connects."""

from __future__ import annotations

import pytest

from run_engine.engine import TriggerRequest

from .conftest import Harness

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


async def test_an_old_worker_gives_a_run_of_a_new_task_back(h: Harness) -> None:
    old = await h.deploy({"id": "a"}, version="old")
    new = await h.deploy({"id": "a"}, {"id": "b"}, version="new")
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="b"))
    assert await h.engine.dequeue(h.env.worker_group_id, 5, deployments=[old]) == []
    assert (await h.engine.get_run(run.id)).status == "QUEUED"  # type: ignore[union-attr]
    assert await h.engine.dequeue(h.env.worker_group_id, 5, deployments=[new]) == []  # not before its turn
    h.clock.advance(0.6)
    (got,) = await h.engine.dequeue(h.env.worker_group_id, 5, deployments=[new])
    assert got.run.id == run.id and got.deliveries == 1  # the old worker's delivery was undone
    runnable = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="a"))
    (mine,) = await h.engine.dequeue(h.env.worker_group_id, 5, deployments=[old])  # a task it has
    assert mine.run.id == runnable.id


async def test_a_task_the_current_deployment_lacks_waits_for_one_that_has_it(h: Harness) -> None:
    await h.deploy({"id": "a"}, {"id": "b"}, version="v1")
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="b"))
    v2 = await h.deploy({"id": "a"}, version="v2")  # b removed: v2 is current
    h.engine.systems.enqueue.invalidate()
    assert await h.engine.dequeue(h.env.worker_group_id, 5, deployments=[v2]) == []
    row = await h.engine.get_run(run.id)
    assert row is not None and row.status == "PENDING_VERSION" and row.attempt_number == 0
    await h.deploy({"id": "a"}, {"id": "b"}, version="v3")
    (got,) = await h.engine.dequeue(h.env.worker_group_id, 5)
    assert got.run.id == run.id
