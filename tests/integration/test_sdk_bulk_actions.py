"""Bulk actions as Trigger.dev's SDK makes and reads them (`/api/v1/bulk-actions`): by run ids or by
the SDK's filter, a filter run-engine cannot honour refused rather than widened, abort, the list."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from run_engine.engine import RunFilter, TriggerRequest
from run_engine.tenancy import ensure_environment

from .conftest import Harness


async def runs(h: Harness, n: int, task: str = "t", tags: tuple[str, ...] = ()) -> list[str]:
    made = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id=task, payload={"i": i},
                                                       tags=tags) for i in range(n)])
    return [m.id for m in made]


async def finish(h: Harness, action_id: str) -> dict[str, Any]:
    """What the engine job does, page after page, until the action is done."""
    while await h.engine.systems.bulk_actions.run_page(action_id):
        pass
    return (await h.client.get(f"/api/v1/bulk-actions/{action_id}")).json()  # type: ignore[attr-defined, no-any-return]


@pytest.fixture
def client(h: Harness, api: httpx.AsyncClient) -> httpx.AsyncClient:
    h.client = api  # type: ignore[attr-defined]
    return api


async def test_cancel_by_run_ids_counts_the_runs_named(h: Harness, client: httpx.AsyncClient) -> None:
    await h.deploy({"id": "t"})
    doomed, kept = await runs(h, 3), await runs(h, 2)
    missing = "run_" + "a" * 24
    made = await client.post("/api/v1/bulk-actions", json={"action": "cancel", "runIds": [*doomed, missing],
                                                           "name": "clean up"})
    assert made.status_code == 200, made.text
    action_id = made.json()["id"]
    pending = (await client.get(f"/api/v1/bulk-actions/{action_id}")).json()
    assert pending["status"] == "PENDING" and pending["type"] == "CANCEL" and pending["name"] == "clean up"
    done = await finish(h, action_id)
    assert done["status"] == "COMPLETED" and done["counts"] == {"total": 4, "success": 3, "failure": 1}
    assert done["completedAt"] >= done["createdAt"]
    assert {(await h.engine.get_run(r)).status for r in doomed} == {"CANCELED"}  # type: ignore[union-attr]
    assert "CANCELED" not in {(await h.engine.get_run(r)).status for r in kept}  # type: ignore[union-attr]


async def test_replay_by_the_sdks_filter(h: Harness, client: httpx.AsyncClient) -> None:
    await h.deploy({"id": "t"}, {"id": "u"})
    await runs(h, 2, "t", ("x",))
    await runs(h, 1, "u", ("x",))
    await runs(h, 1, "t", ("y",))
    made = await client.post("/api/v1/bulk-actions", json={
        "action": "replay", "filter": {"tag": "x", "taskIdentifier": ["t"], "status": ["QUEUED", "PENDING_VERSION"],
                                       "period": "1d", "queue": {"type": "task", "name": "t"}}})
    assert made.status_code == 200, made.text
    done = await finish(h, made.json()["id"])
    assert done["type"] == "REPLAY" and done["counts"] == {"total": 2, "success": 2, "failure": 0}
    tagged = await h.engine.list_runs(h.env.env_id, tags=["x"], tasks=["t"], limit=100)
    assert len(tagged) == 4  # the two and their replays


@pytest.mark.parametrize(("sent", "says"), [
    ({"action": "cancel"}, "exactly one of filter and runIds"),
    ({"action": "cancel", "filter": {"tag": "x"}, "runIds": ["run_x"]}, "exactly one of filter and runIds"),
    ({"action": "cancel", "filter": {}}, "at least one"),
    ({"action": "cancel", "filter": {"tag": ["", " "]}}, "filter.tag"),
    ({"action": "cancel", "filter": {"version": "20250101.1"}}, "filter.version"),
    ({"action": "cancel", "filter": {"isTest": True}}, "filter.isTest"),
    ({"action": "cancel", "filter": {"machine": "small-1x"}}, "filter.machine"),
    ({"action": "cancel", "filter": {"tag": "x", "nope": 1}}, "filter.nope"),
    ({"action": "cancel", "filter": {"status": "DONE"}}, "filter.status"),
    ({"action": "cancel", "filter": {"period": "1d", "from": 0}}, "filter.period"),
    ({"action": "cancel", "filter": {"period": "soon"}}, "filter.period"),
    ({"action": "cancel", "filter": {"from": "yesterday"}}, "filter.from"),
    ({"action": "cancel", "filter": {"to": 1e300}}, "filter.to"),
    ({"action": "cancel", "runIds": ["not-a-run"]}, "runIds"),
    ({"action": "cancel", "runIds": []}, "runIds"),
    ({"action": "replay", "runIds": ["run_x"], "targetRegion": "eu"}, "targetRegion"),
    ({"action": "pause", "runIds": ["run_x"]}, "action"),
    ({"action": "cancel", "runIds": ["run_x"], "name": "n" * 256}, "name"),
])
async def test_a_filter_that_cannot_be_honoured_is_refused(h: Harness, client: httpx.AsyncClient,
                                                           sent: dict[str, Any], says: str) -> None:
    answer = await client.post("/api/v1/bulk-actions", json=sent)
    assert answer.status_code == 400 and says in answer.json()["error"]["message"], answer.text


async def test_abort_stops_an_action_and_the_list_pages_newest_first(h: Harness, client: httpx.AsyncClient) -> None:
    await h.deploy({"id": "t"})
    ids = await runs(h, 3)
    first = (await client.post("/api/v1/bulk-actions", json={"action": "cancel", "runIds": ids[:1]})).json()["id"]
    await finish(h, first)
    second = (await client.post("/api/v1/bulk-actions", json={"action": "cancel", "runIds": ids[1:]})).json()["id"]
    aborted = await client.post(f"/api/v1/bulk-actions/{second}/abort")
    assert aborted.status_code == 200 and aborted.json() == {"id": second}
    assert await h.engine.systems.bulk_actions.run_page(second) is False  # no page after an abort
    got = (await client.get(f"/api/v1/bulk-actions/{second}")).json()
    assert got["status"] == "ABORTED" and got["counts"]["success"] == 0 and "completedAt" in got
    assert "CANCELED" not in {(await h.engine.get_run(r)).status for r in ids[1:]}  # type: ignore[union-attr]
    assert (await client.post(f"/api/v1/bulk-actions/{second}/abort")).status_code == 200  # again: no change
    finished = await client.post(f"/api/v1/bulk-actions/{first}/abort")
    assert finished.status_code == 409 and "completed" in finished.json()["error"]["message"]

    page = (await client.get("/api/v1/bulk-actions", params={"page[size]": "1"})).json()
    assert [a["id"] for a in page["data"]] == [second] and page["pagination"]["next"]
    rest = (await client.get("/api/v1/bulk-actions", params={"page[size]": "1",
                                                              "page[after]": page["pagination"]["next"]})).json()
    assert [a["id"] for a in rest["data"]] == [first]
    for bad in ({"page[size]": "0"}, {"page[after]": "x"}, {"page[after]": "2026-01-01T00:00:00|nope"}):
        assert (await client.get("/api/v1/bulk-actions", params=bad)).status_code == 400, bad


async def test_an_action_is_its_environments_only(h: Harness, client: httpx.AsyncClient) -> None:
    await h.deploy({"id": "t"})
    ids = await runs(h, 1)
    mine = (await client.post("/api/v1/bulk-actions", json={"action": "cancel", "runIds": ids})).json()["id"]
    other = await ensure_environment(h.engine.resources.repo, secret="test-secret", org="other-org", project="p",
                                     env="dev")
    theirs = {"Authorization": f"Bearer {other.api_key}"}
    assert (await client.get(f"/api/v1/bulk-actions/{mine}", headers=theirs)).status_code == 404
    assert (await client.post(f"/api/v1/bulk-actions/{mine}/abort", headers=theirs)).status_code == 404
    assert (await client.get("/api/v1/bulk-actions", headers=theirs)).json()["data"] == []
    # their action naming our run acts on nothing of ours
    made = (await client.post("/api/v1/bulk-actions", json={"action": "cancel", "runIds": ids}, headers=theirs)).json()
    while await h.engine.systems.bulk_actions.run_page(made["id"]):
        pass
    assert (await h.engine.get_run(ids[0])).status != "CANCELED"  # type: ignore[union-attr]
    assert (await client.get("/api/v1/bulk-actions/bulk_nope")).status_code == 404


async def test_an_engine_that_predates_run_ids_acts_on_no_run_of_such_an_action(
        h: Harness, client: httpx.AsyncClient) -> None:
    """An older engine (a rolling deploy, a rollback) reads only the filters it knows: an action by
    run ids must then be an action on nothing, never one on every run of the environment."""
    await h.deploy({"id": "t"})
    ids = await runs(h, 3)
    made = (await client.post("/api/v1/bulk-actions", json={"action": "cancel", "runIds": ids[:1]})).json()["id"]
    action = await h.engine.bulk_action(h.env.env_id, made)
    assert action is not None and action.filter["ids"] == ids[:1]
    as_older = RunFilter.from_stored({k: v for k, v in action.filter.items() if k != "ids"})  # what it sees
    assert await h.engine.resources.repo.runs.list_runs(
        h.env.env_id, created_to=as_older.created_to, limit=100) == []
    assert "created_to" not in (await client.get(f"/api/v1/runs/bulk/{made}")).json()["filter"]


async def test_an_action_whose_filter_this_engine_does_not_know_stops_without_acting(h: Harness) -> None:
    await h.deploy({"id": "t"})
    ids = await runs(h, 2)
    action, _ = await h.engine.create_bulk_action(h.env.env_id, "CANCEL", RunFilter(tasks=("t",)))
    async with h.engine.resources.repo.pool.connection() as conn:  # as a later engine would store one
        await conn.execute("UPDATE bulk_action SET filter = filter || '{\"region\": [\"eu\"]}' WHERE id = %s",
                           (action.id,))
    assert await h.engine.systems.bulk_actions.run_page(action.id) is False
    stopped = await h.engine.bulk_action(h.env.env_id, action.id)
    assert stopped is not None and stopped.status == "ABORTED" and stopped.processed == 0
    assert "CANCELED" not in {(await h.engine.get_run(r)).status for r in ids}  # type: ignore[union-attr]


async def test_a_page_in_hand_when_aborted_still_counts(h: Harness) -> None:
    await h.deploy({"id": "t"})
    await runs(h, 3)
    action, _ = await h.engine.create_bulk_action(h.env.env_id, "CANCEL", RunFilter(tasks=("t",)))
    repo = h.engine.resources.repo.bulk_actions
    await h.engine.abort_bulk_action(h.env.env_id, action.id)  # while a worker acts on the first page
    assert await repo.advance(action.id, expected=(None, None), cursor=None, processed=3, succeeded=3, done=True)
    got = await h.engine.bulk_action(h.env.env_id, action.id)
    assert got is not None and (got.status, got.processed, got.succeeded) == ("ABORTED", 3, 3)


async def test_a_date_that_is_not_one_is_refused(h: Harness, client: httpx.AsyncClient) -> None:
    for bad in (True, None, "tomorrow", [1], {"a": 1}, 10**20):
        answer = await client.post("/api/v1/bulk-actions", json={"action": "cancel", "filter": {"from": bad}})
        assert answer.status_code == 400, (bad, answer.text)


async def test_finished_actions_go_with_retention(make_engine) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await make_engine(retention_days=1e-9)
    await h.deploy({"id": "t"})
    await runs(h, 1)
    done, _ = await h.engine.create_bulk_action(h.env.env_id, "CANCEL", RunFilter(tasks=("nothing",)))
    while await h.engine.systems.bulk_actions.run_page(done.id):
        pass
    pending, _ = await h.engine.create_bulk_action(h.env.env_id, "CANCEL", RunFilter(tasks=("t",)))
    await h.engine.systems.reconciler.retention()
    assert await h.engine.bulk_action(h.env.env_id, done.id) is None
    assert await h.engine.bulk_action(h.env.env_id, pending.id) is not None  # under way: kept


async def test_an_action_made_while_redis_is_away_is_answered_and_done_once(
        h: Harness, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """The action's row committed, then its job could not be scheduled (Redis away): the request
    is answered all the same (a 5xx would make the SDK, which retries one by itself, make the
    action again: every run replayed twice), and the reconciler starts the action."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    await runs(h, 3, task="away")
    jobs = h.engine.resources.jobs
    real = jobs.apply

    async def away(*args: Any, **kwargs: Any) -> Any:
        raise RedisConnectionError("Redis away")

    monkeypatch.setattr(jobs, "apply", away)
    made = await client.post("/api/v1/bulk-actions", json={"action": "replay", "filter": {"taskIdentifier": "away"}})
    monkeypatch.setattr(jobs, "apply", real)
    assert made.status_code == 200, made.text
    assert await h.engine.run_due_jobs() == 0  # no job: the page waits for the reconciler
    await h.engine.systems.reconciler.rearm_jobs(grace_s=-1, full=True)
    for _ in range(10):  # the re-armed job runs the action page after page
        await h.engine.run_due_jobs()
        done = (await client.get(f"/api/v1/bulk-actions/{made.json()['id']}")).json()
        if done["status"] != "PENDING":
            break
    assert done["status"] == "COMPLETED" and done["counts"] == {"total": 3, "success": 3, "failure": 0}
    assert len(await h.engine.list_runs(h.env.env_id, tasks=["away"], limit=100)) == 6
