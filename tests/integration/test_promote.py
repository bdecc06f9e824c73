"""A promote (``POST /api/v1/deployments/{version}/promote``, ``run-engine promote VERSION``) makes an
older deployment current again, a rollback, as a connect that makes a deployment current does (its
queue settings, crons and waiting runs), and it sticks: the newer version's own workers connecting
again leave it current; a new version connecting after it is current."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx
import pytest

from run_engine.engine import TriggerRequest
from run_engine.ids import new_id
from run_engine.tenancy import ensure_environment

from .conftest import Harness, api_client

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)

A_TASKS = ({"id": "shared", "queue": "q", "maxDuration": 60}, {"id": "only-a", "cron": "0 * * * *"})
A_QUEUES = [{"name": "q", "concurrencyLimit": 5}]
B_TASKS = ({"id": "shared", "queue": "q", "maxDuration": 120}, {"id": "only-b", "cron": "30 * * * *"})
B_QUEUES = [{"name": "q", "concurrencyLimit": 10}]
CONNECT = "/engine/v1/worker-actions/connect"


async def _current(h: Harness, task: str) -> str | None:
    found = await h.engine.resources.repo.deployments.current_task(h.env.env_id, h.env.worker_group_id, task)
    return None if found is None else found.deployment_id


async def _crons(h: Harness) -> set[str]:
    return {s.task_id for s in await h.engine.list_schedules(h.env.env_id, 10, None)}


async def _locked_to(h: Harness, task: str) -> tuple[str, str | None]:
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id=task))
    row = await h.engine.get_run(run.id)
    assert row is not None
    return row.status, row.locked_to_deployment_id


async def test_a_promote_makes_the_older_deployment_current_and_the_newer_ones_workers_leave_it(
        h: Harness) -> None:
    a = await h.deploy(*A_TASKS, queues=A_QUEUES, version="A")
    b = await h.deploy(*B_TASKS, queues=B_QUEUES, version="B")
    waiting = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="only-a"))  # B lacks it
    assert (await h.engine.get_run(waiting.id)).status == "PENDING_VERSION"  # type: ignore[union-attr]

    (promoted,) = await h.engine.promote_deployment(h.env.env_id, "A")
    assert (promoted.deployment_id, promoted.version, promoted.worker_group_id) == (a, "A", h.env.worker_group_id)
    assert not promoted.already_current and promoted.pending_runs_enqueued == 1

    async def a_is_current() -> None:
        assert await _current(h, "shared") == a and await _current(h, "only-a") == a
        assert await _current(h, "only-b") is None
        deps = h.engine.resources.repo.deployments
        shared = await deps.current_task(h.env.env_id, h.env.worker_group_id, "shared")
        assert shared is not None and shared.version == "A" and shared.max_duration_s == 60  # A's settings
        queue = await deps.task_queue(h.env.env_id, "q")
        assert queue is not None and queue.concurrency_limit == 5  # A's limit, written back
        assert (await h.engine.queue_stats(h.env.env_id, "q")).limit == 5  # and in the run queue
        assert await _crons(h) == {"only-a"}  # A's crons, B's gone
        assert await _locked_to(h, "shared") == ("QUEUED", a)  # triggers take A's task settings
        assert (await _locked_to(h, "only-b"))[0] == "PENDING_VERSION"

    await a_is_current()
    row = await h.engine.get_run(waiting.id)  # the run that waited for a deployment with its task
    assert row is not None and row.status == "QUEUED" and row.locked_to_deployment_id == a

    # B's workers connect again (a restart, a dropped connection): A stays current, B is answered as before
    assert await h.deploy(*B_TASKS, queues=B_QUEUES, version="B") == b
    await a_is_current()
    assert await h.deploy(*A_TASKS, queues=A_QUEUES, version="A") == a  # A's own: nothing moves either
    await a_is_current()

    # a new version connecting after the promote is current, B's workers again do not undo it
    c = await h.deploy({"id": "shared", "queue": "q"}, {"id": "only-c"}, queues=[{"name": "q"}], version="C")
    assert await h.deploy(*B_TASKS, queues=B_QUEUES, version="B") == b
    assert await _current(h, "shared") == c and await _current(h, "only-c") == c
    assert await _locked_to(h, "only-c") == ("QUEUED", c)
    assert await _crons(h) == set()

    # and B promoted in its turn (forward again) is current, its settings back
    (forward,) = await h.engine.promote_deployment(h.env.env_id, "B")
    assert forward.deployment_id == b and not forward.already_current
    assert await _current(h, "shared") == b and await _crons(h) == {"only-b"}
    assert (await h.engine.queue_stats(h.env.env_id, "q")).limit == 10
    assert await h.deploy({"id": "shared", "queue": "q"}, {"id": "only-c"}, queues=[{"name": "q"}], version="C") == c
    assert await _current(h, "shared") == b


async def test_a_promote_of_an_unknown_version_is_nothing_and_of_the_current_one_changes_nothing(
        h: Harness) -> None:
    await h.deploy(*A_TASKS, queues=A_QUEUES, version="A")
    b = await h.deploy(*B_TASKS, queues=B_QUEUES, version="B")
    assert await h.engine.promote_deployment(h.env.env_id, "Z") == []
    assert await h.engine.promote_deployment(h.env.env_id, "a") == []  # versions are exact
    assert await _current(h, "shared") == b
    deps = h.engine.resources.repo.deployments
    (before,) = await deps.deployments_of_version(h.env.env_id, "B")
    async with deps.pool.connection() as conn:
        stamp = await (await conn.execute("SELECT made_current_at FROM deployment WHERE id = %s", (b,))).fetchone()
    (same,) = await h.engine.promote_deployment(h.env.env_id, "B")
    assert same.deployment_id == b and same.already_current and same.pending_runs_enqueued == 0
    assert before.is_current and await _current(h, "shared") == b and await _crons(h) == {"only-b"}
    async with deps.pool.connection() as conn:
        assert await (await conn.execute("SELECT made_current_at FROM deployment WHERE id = %s",
                                         (b,))).fetchone() == stamp  # not made current again: the same
    # another environment's version is not this one's
    other = await ensure_environment(h.engine.resources.repo, secret="test-secret", org=new_id("org"),
                                     project="p", env="dev")
    assert await h.engine.promote_deployment(other.env_id, "A") == []


async def test_a_promote_finding_many_runs_waiting_enqueues_a_bounded_number_and_a_job_the_rest(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The connect's path: CONNECT_PROMOTE at once, the rest by the promote_pending job. A job of
    the deployment the promote replaced stops: its tasks' runs are not handed to it any more."""
    import systems.waiting_for_worker as module

    monkeypatch.setattr(module, "CONNECT_PROMOTE", 2)
    monkeypatch.setattr(module, "PROMOTE_PAGE", 2)
    a = await h.deploy({"id": "late"}, {"id": "gone"}, version="A")
    await h.deploy({"id": "other"}, version="B")
    runs = [await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id=t))
            for t in ("late", "gone") * 3]
    assert {(await h.engine.get_run(r.id)).status for r in runs} == {"PENDING_VERSION"}  # type: ignore[union-attr]
    (promoted,) = await h.engine.promote_deployment(h.env.env_id, "A")
    assert promoted.pending_runs_enqueued == 2
    for _ in range(10):  # the job's pages, each scheduling the next
        if not await h.advance(0):
            break
    rows = [await h.engine.get_run(r.id) for r in runs]
    assert [(r.status, r.locked_to_deployment_id) for r in rows if r is not None] == [("QUEUED", a)] * 6


async def test_the_job_of_a_deployment_no_longer_current_stops(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """B's connect left runs for its job; A promoted meanwhile: the job enqueues none of them on
    B (a run of a task only B has would be locked to a version just rolled back)."""
    import systems.waiting_for_worker as module

    monkeypatch.setattr(module, "CONNECT_PROMOTE", 1)
    await h.deploy({"id": "x"}, version="A")
    runs = [await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="only-b")) for _ in range(3)]
    await h.deploy({"id": "x"}, {"id": "only-b"}, version="B")  # one enqueued, a job for the rest
    await h.engine.promote_deployment(h.env.env_id, "A")
    for _ in range(10):
        if not await h.advance(0):
            break
    statuses = sorted([(await h.engine.get_run(r.id)).status for r in runs])  # type: ignore[union-attr]
    assert statuses == ["PENDING_VERSION", "PENDING_VERSION", "QUEUED"]


async def test_promote_over_http(h: Harness, api: httpx.AsyncClient) -> None:
    def declaration(version: str, *tasks: str) -> dict[str, Any]:
        return {"workerInstanceName": f"w-{len(version)}",
                "deployment": {"version": version, "tasks": [{"id": t} for t in tasks]}}

    odd = "release/2024-ü版 v1"  # a slash, unicode and a space: URL-encoded in the path
    async with api_client(h, h.env.worker_group_token) as worker:
        first = await worker.post(CONNECT, json=declaration(odd, "a"))
        assert first.status_code == 200, first.text
        second = await worker.post(CONNECT, json=declaration("v2", "a", "b"))
        assert second.status_code == 200, second.text
    path = f"/api/v1/deployments/{quote(odd, safe='')}/promote"
    answer = await api.post(path)  # no body, as Trigger.dev's CLI sends it
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body == {"id": first.json()["deploymentId"], "version": odd, "workerGroupId": h.env.worker_group_id,
                    "alreadyCurrent": False, "pendingRunsEnqueued": 0, "deployments": [
                        {"id": first.json()["deploymentId"], "version": odd, "workerGroupId": h.env.worker_group_id,
                         "alreadyCurrent": False, "pendingRunsEnqueued": 0}]}
    run = await api.post("/api/v1/tasks/b/trigger", json={"payload": {}})
    assert (await h.engine.get_run(run.json()["id"])).status == "PENDING_VERSION"  # type: ignore[union-attr]
    again = await api.post(path, json={})
    assert again.status_code == 200 and again.json()["alreadyCurrent"] is True, again.text
    # the worker group by name, as a trigger's workerGroup; unknown: 400 naming it
    group = (await api.get("/api/v1/worker-groups")).json()["data"][0]["name"]
    named = await api.post("/api/v1/deployments/v2/promote", json={"workerGroup": group})
    assert named.status_code == 200 and named.json()["pendingRunsEnqueued"] == 1, named.text
    for payload, status, code, words in (
        ({"workerGroup": "nope"}, 400, "invalid_input", "workerGroup"),
        ({"workerGroup": ""}, 400, "invalid_input", "workerGroup"),
        ({"workerGroup": 5}, 400, "invalid_input", "workerGroup"),
    ):
        bad = await api.post("/api/v1/deployments/v2/promote", json=payload)
        assert (bad.status_code, bad.json()["error"]["code"]) == (status, code), bad.text
        assert words in bad.json()["error"]["message"]
    for version, status, code in (("v9", 404, "not_found"), ("V2", 404, "not_found"),
                                  ("%F0%9F%92%A9", 404, "not_found"), ("x" * 129, 400, "invalid_input"),
                                  ("%00", 400, "invalid_input"), ("%FF", 400, "invalid_input"),
                                  ("..%2F..", 404, "not_found")):
        bad = await api.post(f"/api/v1/deployments/{version}/promote")
        assert (bad.status_code, bad.json()["error"]["code"]) == (status, code), (version, bad.text)
    assert (await api.post("/api/v1/deployments//promote")).status_code == 400
    malformed = await api.post(path, content=b"{", headers={"content-type": "application/json"})
    assert malformed.status_code == 400, malformed.text
    # a worker group token is no environment's secret key, nor is none
    async with api_client(h, h.env.worker_group_token) as worker:
        assert (await worker.post(path)).status_code == 403
    assert (await api.post(path, headers={"Authorization": ""})).status_code == 401
