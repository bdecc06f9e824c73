"""From a review of deployments, connect, worker groups and versions: a run triggered with
``lockToVersion`` runs on that version only (refused when no deployment of that version has its
task), and a connect answers the version of the deployment it registered."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from .conftest import Harness, api_client

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)

CONNECT = "/engine/v1/worker-actions/connect"


async def _trigger(api: httpx.AsyncClient, task: str, **options: Any) -> httpx.Response:
    return await api.post(f"/api/v1/tasks/{task}/trigger", json={"payload": {}, "options": options})


async def test_a_run_locked_to_a_version_runs_on_that_version_only(h: Harness, api: httpx.AsyncClient) -> None:
    old = await h.deploy({"id": "a", "queue": "old-q"}, {"id": "only-old"}, queues=[{"name": "old-q"}],
                         version="old")
    new = await h.deploy({"id": "a"}, {"id": "b"}, version="new")  # current from now on
    answer = await _trigger(api, "a", lockToVersion="old")
    assert answer.status_code == 200, answer.text
    run = await h.engine.get_run(answer.json()["id"])
    assert run is not None and run.status == "QUEUED"
    # locked to the version it named (its settings, its queue there), not the current one
    assert run.locked_to_deployment_id == old and run.queue == "old-q"
    # a worker of the current version is not handed it: the run waits for a worker of its version
    assert await h.engine.dequeue(h.env.worker_group_id, 5, deployments=[new]) == []
    again = await h.engine.get_run(run.id)
    assert again is not None and again.status == "QUEUED"
    h.clock.advance(0.6)
    (got,) = await h.engine.dequeue(h.env.worker_group_id, 5, deployments=[old])
    assert got.run.id == run.id
    # a task of a replaced version only: locked to it, never PENDING_VERSION
    answer = await _trigger(api, "only-old", lockToVersion="old")
    assert answer.status_code == 200, answer.text
    assert await h.engine.dequeue(h.env.worker_group_id, 5, deployments=[new]) == []
    row = await h.engine.get_run(answer.json()["id"])
    assert row is not None and row.status == "QUEUED" and row.locked_to_deployment_id == old
    # without the option a run is the current version's, as before
    plain = await _trigger(api, "a")
    row = await h.engine.get_run(plain.json()["id"])
    assert row is not None and row.locked_to_deployment_id == new


async def test_a_lock_to_a_version_that_cannot_run_the_task_is_refused(h: Harness, api: httpx.AsyncClient) -> None:
    """A version no deployment of the environment has (never connected), or one without the task:
    400 at once, rather than a run that no worker could ever take."""
    await h.deploy({"id": "a"}, version="v1")
    await h.deploy({"id": "a"}, {"id": "b"}, version="v2")
    for task, version in (("a", "v9"), ("b", "v1"), ("a", "1 ")):
        answer = await _trigger(api, task, lockToVersion=version)
        assert answer.status_code == 400, answer.text
        assert "lockToVersion" in answer.json()["error"]["message"]
    batch = await api.post("/api/v1/tasks/batch", json={"items": [
        {"task": "a", "payload": {}}, {"task": "a", "payload": {}, "options": {"lockToVersion": "v9"}}]})
    assert batch.status_code == 400, batch.text


async def test_a_connect_answers_the_version_of_the_deployment_it_registered(h: Harness) -> None:
    """The same tasks connected again under another version are the deployment registered before
    (content-hashed): the answer names that deployment's version, not the one asked for, which no
    deployment has (a trigger locking to it would be refused)."""
    body = {"workerInstanceName": "w", "deployment": {"version": "first", "tasks": [{"id": "x"}]}}
    async with api_client(h, h.env.worker_group_token) as worker:
        first = await worker.post(CONNECT, json=body)
        assert first.status_code == 200 and first.json()["version"] == "first", first.text
        body["deployment"]["version"] = "second"  # type: ignore[index]
        again = await worker.post(CONNECT, json=body)
        assert again.status_code == 200, again.text
        assert again.json()["deploymentId"] == first.json()["deploymentId"]
        assert again.json()["version"] == "first"


async def test_explain_says_a_run_waits_for_a_worker_of_the_version_it_is_locked_to(
        h: Harness, api: httpx.AsyncClient) -> None:
    """A run locked to a replaced version is given back by every worker of the current one, for as
    long as no worker of its version asks for work: it is never PENDING_VERSION, so explain read
    its queue and said it was READY ("starts as soon as a worker of its group asks for work") or
    waiting out a retry's back-off (the give-back's 500 ms), neither true. It names the lock."""
    from run_engine.api.serialize import explanation_object
    old = await h.deploy({"id": "a"}, version="old")
    new = await h.deploy({"id": "a"}, {"id": "b"}, version="new")
    answer = await _trigger(api, "a", lockToVersion="old")
    run_id = answer.json()["id"]
    for _ in range(2):
        out = explanation_object(await h.engine.explain(h.env.env_id, run_id))
        first = out["reasons"][0]
        assert first["code"] == "LOCKED_TO_VERSION", out
        assert "'old'" in first["message"] and "not the current" in first["message"], out
        assert await h.engine.dequeue(h.env.worker_group_id, 5, deployments=[new]) == []  # given back
    h.clock.advance(0.6)
    (got,) = await h.engine.dequeue(h.env.worker_group_id, 5, deployments=[old])
    assert got.run.id == run_id


async def test_a_run_locked_to_a_version_keeps_its_deployment_when_another_promotes_it(
        h: Harness, api: httpx.AsyncClient) -> None:
    """An engine process of the version before ignores lockToVersion, and may make a locked run
    PENDING_VERSION; the next registration's promotion then moved the lock to its own deployment
    (another version) and the run to its queue. A locked run keeps both."""
    old = await h.deploy({"id": "a", "queue": "old-q"}, queues=[{"name": "old-q"}], version="old")
    new = await h.deploy({"id": "a"}, version="new")
    answer = await _trigger(api, "a", lockToVersion="old")
    run_id = answer.json()["id"]
    runs = h.engine.resources.repo.runs
    async with runs.pool.connection() as conn:  # as a process of the version before would leave it
        await conn.execute("UPDATE task_run SET status = 'PENDING_VERSION' WHERE id = %s", (run_id,))
    await runs.assign_deployment([run_id], new, {"a": "task/a"})
    row = await h.engine.get_run(run_id)
    assert row is not None and row.locked_to_deployment_id == old and row.queue == "old-q"


async def test_a_run_no_worker_asking_can_take_is_given_back_ever_later(
        h: Harness, api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run locked to a version whose workers are gone was handed to the current version's
    workers and given back twice a second for good (each time a dequeue, a look-up and a Lua call
    the group's workers paid for). Given back eight times in a row, it then waits twice as long
    each time, up to 30 s; a worker of its version still gets it."""
    old = await h.deploy({"id": "a"}, version="old")
    new = await h.deploy({"id": "a"}, version="new")
    run_id = (await _trigger(api, "a", lockToVersion="old")).json()["id"]
    queue = h.engine.resources.queue
    given_back: list[str] = []
    give_back = queue.give_back

    async def counted(env_id: str, rid: str, *args: Any) -> Any:
        given_back.append(rid)
        return await give_back(env_id, rid, *args)

    monkeypatch.setattr(queue, "give_back", counted)
    for _ in range(240):  # two minutes of a worker of the current version asking every 0.5 s
        assert await h.engine.dequeue(h.env.worker_group_id, 5, deployments=[new]) == []
        h.clock.advance(0.5)
    # every 0.5 s eight times, then 1, 2, 4, 8, 16 and every 30 s: about 16 in two minutes (before: 240)
    assert 10 <= len(given_back) <= 24, len(given_back)
    row = await h.engine.get_run(run_id)
    assert row is not None and row.status == "QUEUED"
    h.clock.advance(31)
    (got,) = await h.engine.dequeue(h.env.worker_group_id, 5, deployments=[old])
    assert got.run.id == run_id


async def test_an_old_workers_connect_over_http_leaves_the_newer_deployment_current(
        h: Harness, api: httpx.AsyncClient) -> None:
    """A worker of version A connects again after B did (a rolling deploy): it is answered as
    before (A's deployment and version) and B stays current: triggers are B's."""
    def declaration(version: str, *tasks: str) -> dict[str, Any]:
        return {"workerInstanceName": f"w-{version}",
                "deployment": {"version": version, "tasks": [{"id": t} for t in tasks]}}

    async with api_client(h, h.env.worker_group_token) as worker:
        first = await worker.post(CONNECT, json=declaration("A", "a"))
        assert first.status_code == 200, first.text
        b = await worker.post(CONNECT, json=declaration("B", "a", "b"))
        assert b.status_code == 200, b.text
        again = await worker.post(CONNECT, json=declaration("A", "a"))
        assert again.status_code == 200, again.text
    assert again.json() == first.json()  # the same answer: A's deployment, A's version
    for task in ("a", "b"):
        answer = await _trigger(api, task)
        assert answer.status_code == 200, answer.text
        run = await h.engine.get_run(answer.json()["id"])
        assert run is not None and run.status == "QUEUED", run
        assert run.locked_to_deployment_id == b.json()["deploymentId"]
