"""The API contract over HTTP: DLQ redrive, queues, batches, SDK, OpenAPI, and bad input of
every kind answered with the documented status and error shape, never a 500, nothing written."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from .conftest import Stack

W = "/engine/v1/worker-actions"


@pytest.fixture(scope="module")
def lonely(stack: Stack) -> Stack:
    """A project no supervisor serves: the tests drive its worker API by hand."""
    own = stack.project("byhand")
    with own.worker() as w:
        r = w.post(f"{W}/connect", json={"workerInstanceName": "hand", "deployment": {
            "tasks": [{"id": "manual"}, {"id": "manual-2", "queue": "custom-q"}],
            "queues": [{"name": "custom-q", "concurrencyLimit": 3}]}})
    assert r.status_code == 200, r.text
    return own


def dequeue(w: httpx.Client, wait_ms: int = 0) -> list[dict[str, Any]]:
    r = w.post(f"{W}/dequeue", json={"maxRuns": 10, "waitMs": wait_ms})
    assert r.status_code == 200, r.text
    runs: list[dict[str, Any]] = r.json()["runs"]
    return runs


def test_dead_letter_and_redrive_through_the_api(lonely: Stack) -> None:
    run_id = lonely.trigger("manual", {"x": 1})
    with lonely.worker() as w, lonely.client() as c:
        # dequeued twice (RUN_ENGINE_MAX_DELIVERIES=2) and never started: the run is dead-lettered
        deadline = time.monotonic() + 60
        while lonely.run(run_id)["status"] != "SYSTEM_FAILURE":
            dequeue(w, wait_ms=500)
            assert time.monotonic() < deadline, lonely.run(run_id)["status"]
        dlq = c.get("/api/v1/dlq").json()["data"]
        entry = next(e for e in dlq if e["run"]["id"] == run_id)
        assert entry["deliveries"] == 2 and entry["reason"] and entry["deadAt"]
        assert c.get("/api/v1/dlq", params={"filter[taskIdentifier]": "other"}).json()["data"] == []
        assert c.post(f"/api/v1/dlq/{run_id}/redrive").json() == {"id": run_id}
        assert lonely.run(run_id)["status"] == "QUEUED"
        assert c.post(f"/api/v1/dlq/{run_id}/redrive").status_code == 409  # not dead-lettered any more
        [item] = dequeue(w, wait_ms=2000)
        assert item["run"]["id"] == run_id
        start = w.post(f"{W}/runs/{run_id}/snapshots/{item['snapshot']['id']}/attempts/start").json()
        assert start["payload"] == {"x": 1} and start["attemptNumber"] == 1
        done = w.post(f"{W}/runs/{run_id}/snapshots/{start['snapshot']['id']}/attempts/complete",
                      json={"ok": True, "output": "redriven"})
        assert done.json()["action"] == "finished"
    assert lonely.run(run_id)["output"] == "redriven"


def test_redrive_all_matching(lonely: Stack) -> None:
    ids = [lonely.trigger("manual-2", i) for i in range(2)]
    with lonely.worker() as w, lonely.client() as c:
        deadline = time.monotonic() + 60
        while any(lonely.run(i)["status"] != "SYSTEM_FAILURE" for i in ids):
            dequeue(w, wait_ms=500)
            assert time.monotonic() < deadline
        assert c.post("/api/v1/dlq/redrive", json={"queue": "custom-q"}).json() == {"redriven": 2}
        assert {lonely.run(i)["status"] for i in ids} == {"QUEUED"}
        got = {r["run"]["id"] for r in dequeue(w, wait_ms=1000)}
        assert set(ids) <= got


def test_long_poll_returns_as_soon_as_work_arrives(lonely: Stack) -> None:
    async def scenario() -> tuple[float, list[Any]]:
        async with httpx.AsyncClient(base_url=lonely.url, headers={"Authorization": f"Bearer {lonely.token}"},
                                     timeout=30) as w:
            poll = asyncio.create_task(w.post(f"{W}/dequeue", json={"maxRuns": 1, "waitMs": 10_000}))
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            await asyncio.to_thread(lonely.trigger, "manual", "wake")
            response = await poll
            return time.monotonic() - t0, response.json()["runs"]

    elapsed, runs = asyncio.run(scenario())
    assert len(runs) == 1 and elapsed < 5  # well before the 10 s wait ran out


def test_queues_list_get_and_concurrency_override(lonely: Stack) -> None:
    with lonely.client() as c:
        names = {q["name"] for q in c.get("/api/v1/queues").json()["data"]}
        assert {"task/manual", "custom-q"} <= names
        q = c.get("/api/v1/queues/custom-q").json()
        assert (q["concurrencyLimit"], q["type"], q["paused"]) == (3, "custom", False)  # a queue a user names is custom
        assert c.post("/api/v1/queues/custom-q/concurrency/override", json={"concurrencyLimit": 1}).json()[
            "concurrencyLimit"] == 1
        assert c.post("/api/v1/queues/custom-q/concurrency/reset").json()["concurrencyLimit"] == 3
        assert c.get("/api/v1/queues/nope").status_code == 404


def test_batch_trigger_and_get_batch(lonely: Stack) -> None:
    with lonely.client() as c:
        r = c.post("/api/v1/tasks/batch", json={"items": [
            {"task": "manual", "payload": 1}, {"task": "manual-2", "payload": 2, "options": {"tags": ["b"]}}]})
        assert r.status_code == 200, r.text
        batch = r.json()
        assert [x["taskIdentifier"] for x in batch["runs"]] == ["manual", "manual-2"]
        got = c.get(f"/api/v1/batches/{batch['id']}").json()
        assert got["runCount"] == 2 and got["status"] == "PENDING"
        listed = c.get("/api/v1/runs", params={"filter[batch]": batch["id"]}).json()["data"]
        assert {x["id"] for x in listed} == {x["id"] for x in batch["runs"]}
        tagged = c.get("/api/v1/runs", params={"filter[tag]": "b", "filter[batch]": batch["id"]}).json()["data"]
        assert [x["id"] for x in tagged] == [batch["runs"][1]["id"]]


def test_list_runs_paginates_newest_first(lonely: Stack) -> None:
    ids = [lonely.trigger("manual", i, tags=["page"]) for i in range(5)]
    seen: list[str] = []
    after = None
    with lonely.client() as c:
        while True:
            params = {"filter[tag]": "page", "page[size]": "2", **({"page[after]": after} if after else {})}
            page = c.get("/api/v1/runs", params=params).json()
            seen += [r["id"] for r in page["data"]]
            after = page["pagination"].get("next")
            if not after:
                break
    assert seen == list(reversed(ids))


def test_sdk_triggers_and_reads_runs(lonely: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    from run_engine.sdk import runs, task

    @task(id="manual")
    def manual(payload: Any) -> Any:
        return payload

    monkeypatch.setenv("RUN_ENGINE_API_URL", lonely.url)
    monkeypatch.setenv("RUN_ENGINE_API_KEY", lonely.api_key)

    async def scenario() -> dict[str, Any]:
        handle = await manual.trigger({"via": "sdk"})
        batch = await manual.batch_trigger([1, 2])
        assert len(batch) == 2
        return await runs.retrieve(handle.id)

    run = asyncio.run(scenario())
    assert run["payload"] == {"via": "sdk"} and run["status"] == "QUEUED"


def test_openapi_and_health(stack: Stack) -> None:
    doc = httpx.get(f"{stack.url}/openapi.json").json()
    assert doc["openapi"].startswith("3.") and "/api/v1/tasks/{taskId}/trigger" in doc["paths"]
    assert "TriggerBody" in doc["components"]["schemas"]
    assert httpx.get(f"{stack.url}/healthz").json() == {"ok": True, "dependencies": {"postgres": "up", "redis": "up"}}
    index = httpx.get(f"{stack.url}/")  # directions, not a bare 404
    assert index.status_code == 200 and index.json()["health"] == "/healthz" and index.json()["version"] != ""
    assert "/" in doc["paths"]


# --- bad input ----------------------------------------------------------------------------------

def _count_runs(stack: Stack) -> int:
    with stack.client() as c:
        return len(c.get("/api/v1/runs", params={"page[size]": "100"}).json()["data"])


BODY_ENDPOINTS = [
    ("POST", "/api/v1/tasks/manual/trigger", {"payload": 1, "options": {"maxAttempts": "many"}}, "options.maxAttempts"),
    ("POST", "/api/v1/tasks/manual/trigger", {"payload": 1, "options": {"tags": ["x"] * 11}}, "options.tags"),
    ("POST", "/api/v1/tasks/manual/trigger", {"payload": 1, "options": {"priority": -1}}, "options.priority"),
    ("POST", "/api/v1/tasks/manual/trigger", {"payload": 1, "options": {"ttl": "soon"}}, "options.ttl"),
    ("POST", "/api/v1/tasks/manual/trigger", {"payload": 1, "options": {"queue": ""}}, "options.queue"),
    ("POST", "/api/v1/tasks/manual/trigger", {"payload": 1, "options": {"delay": "whenever"}}, "options.delay"),
    ("POST", "/api/v1/tasks/manual/trigger", {"payload": 1, "options": {"idempotencyKeyTTL": "x"}},
     "options.idempotencyKeyTTL"),
    ("POST", "/api/v1/tasks/batch", {"items": []}, "items"),
    ("POST", "/api/v1/tasks/batch", {"items": [{"payload": 1}]}, "items.0.task"),
    ("POST", "/api/v1/tasks/batch", {"items": [{"task": "manual"}] * 1001}, "items"),
    ("POST", "/api/v1/queues/custom-q/pause", {"action": "stop"}, "action"),
    ("POST", "/api/v1/queues/custom-q/concurrency/override", {"concurrencyLimit": "x"}, "concurrencyLimit"),
    ("POST", "/api/v1/queues/custom-q/concurrency/override", {}, "concurrencyLimit"),
    ("POST", "/api/v1/waitpoints/tokens", {"timeout": "soon"}, "timeout"),
    ("POST", "/api/v1/waitpoints/tokens", {"idempotencyKeyTTL": -5}, "idempotencyKeyTTL"),
    ("POST", "/api/v1/waitpoints/tokens", {"tags": ["x"] * 11}, "tags"),
    ("POST", "/api/v1/waitpoints/tokens", {"tags": [""]}, "tags"),
]


@pytest.mark.parametrize(("method", "path", "payload", "field"), BODY_ENDPOINTS)
def test_wrong_or_missing_fields_are_400_naming_the_field(lonely: Stack, method: str, path: str,
                                                          payload: Any, field: str) -> None:
    before = _count_runs(lonely)
    with lonely.client() as c:
        r = c.request(method, path, json=payload)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_input" and err["message"].startswith(field)
    assert _count_runs(lonely) == before


JSON_ENDPOINTS = ["/api/v1/tasks/manual/trigger", "/api/v1/tasks/batch", "/api/v1/queues/custom-q/pause",
                  "/api/v1/queues/custom-q/concurrency/override", "/api/v1/dlq/redrive", "/api/v1/waitpoints/tokens"]


@pytest.mark.parametrize("path", JSON_ENDPOINTS)
def test_malformed_json_is_400(lonely: Stack, path: str) -> None:
    with lonely.client() as c:
        for raw in (b"{not json", b"[1, 2]", b'"string"'):
            r = c.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, raw, r.text)
            assert set(r.json()["error"]) >= {"code", "message"}


PUBLIC = [("POST", "/api/v1/tasks/manual/trigger"), ("POST", "/api/v1/tasks/batch"), ("GET", "/api/v1/runs"),
          ("GET", "/api/v3/runs/run_x"), ("POST", "/api/v2/runs/run_x/cancel"), ("POST", "/api/v1/runs/run_x/replay"),
          ("GET", "/api/v1/queues"), ("GET", "/api/v1/queues/custom-q"), ("GET", "/api/v1/dlq"),
          ("POST", "/api/v1/dlq/redrive"), ("POST", "/api/v1/dlq/run_x/redrive"), ("GET", "/api/v1/batches/batch_x"),
          ("POST", "/api/v1/waitpoints/tokens"), ("GET", "/api/v1/waitpoints/tokens"),
          ("POST", "/api/v1/runs/run_x/reschedule"), ("PUT", "/api/v1/runs/run_x/metadata"),
          ("POST", "/api/v1/runs/run_x/tags"), ("GET", "/api/v1/runs/run_x/explain"),
          ("POST", "/api/v1/schedules"), ("GET", "/api/v1/schedules"), ("GET", "/api/v1/schedules/sched_x"),
          ("GET", "/api/v1/waitpoints/tokens/waitpoint_x"), ("POST", "/api/v1/waitpoints/tokens/waitpoint_x/complete")]
WORKER = [("POST", f"{W}/connect"), ("POST", f"{W}/dequeue"), ("POST", f"{W}/heartbeat"),
          ("POST", f"{W}/attempts/start"), ("POST", f"{W}/attempts/complete"),
          ("GET", f"{W}/runs/run_x/snapshots/latest"), ("POST", f"{W}/runs/run_x/snapshots/s/attempts/start"),
          ("POST", f"{W}/runs/run_x/snapshots/s/attempts/complete"), ("POST", f"{W}/runs/run_x/snapshots/s/heartbeat"),
          ("POST", f"{W}/runs/run_x/snapshots/s/suspend"), ("POST", f"{W}/runs/run_x/snapshots/s/continue"),
          ("POST", f"{W}/runs/run_x/snapshots/s/wait/duration"), ("POST", f"{W}/runs/run_x/snapshots/s/trigger"),
          ("POST", f"{W}/runs/run_x/snapshots/s/waitpoints/w/wait"), ("POST", f"{W}/runs/run_x/journal"),
          ("GET", f"{W}/runs/run_x/journal")]


@pytest.mark.parametrize(("method", "path"), PUBLIC + WORKER)
def test_missing_bad_and_wrong_scope_credentials(lonely: Stack, method: str, path: str) -> None:
    is_worker = path.startswith(W)
    right, wrong = (lonely.token, lonely.api_key) if is_worker else (lonely.api_key, lonely.token)
    del right
    for headers, status in (({}, 401), ({"Authorization": "Bearer nope"}, 401), ({"Authorization": "Basic x"}, 401),
                            ({"Authorization": f"Bearer {wrong}"}, 403)):
        r = httpx.request(method, f"{lonely.url}{path}", headers=headers, json={})
        assert r.status_code == status, (path, headers, r.text)
        assert r.json()["error"]["code"] in ("unauthorized", "forbidden")


def test_unknown_ids_and_other_environments_ids_are_404(stack: Stack, lonely: Stack) -> None:
    theirs = stack.trigger("echo", "mine")  # another project's run
    with lonely.client() as c:
        for run_id in ("run_doesnotexist", theirs):
            for method, path in (("GET", f"/api/v3/runs/{run_id}"), ("POST", f"/api/v2/runs/{run_id}/cancel"),
                                 ("POST", f"/api/v1/runs/{run_id}/replay"), ("POST", f"/api/v1/dlq/{run_id}/redrive"),
                                 ("POST", f"/api/v1/runs/{run_id}/reschedule"),
                                 ("PUT", f"/api/v1/runs/{run_id}/metadata"), ("POST", f"/api/v1/runs/{run_id}/tags"),
                                 ("GET", f"/api/v1/runs/{run_id}/explain")):
                r = c.request(method, path, json={"delay": "1s", "metadata": {}, "tags": ["t"]})
                assert r.status_code == 404, (method, path, r.text)
                assert r.json()["error"]["code"] == "not_found"
    with lonely.worker() as w:
        r = w.get(f"{W}/runs/{theirs}/snapshots/latest")
        assert r.status_code == 404
        for path, body in ((f"{W}/runs/{theirs}/journal", {"snapshotId": "s", "sequence": 0, "key": "k"}),
                           (f"{W}/runs/{theirs}/snapshots/s/suspend", None),
                           (f"{W}/runs/{theirs}/snapshots/s/wait/duration", {"sequence": 0, "seconds": 1})):
            assert w.post(path, json=body).status_code == 404, path
    theirs_token = create_token_for(stack)
    with lonely.client() as c:
        for method, path in (("GET", f"/api/v1/waitpoints/tokens/{theirs_token}"),
                             ("POST", f"/api/v1/waitpoints/tokens/{theirs_token}/complete"),
                             ("GET", "/api/v1/waitpoints/tokens/waitpoint_nope")):
            r = c.request(method, path, json={})
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (path, r.text)
    with stack.client() as c:
        assert c.get(f"/api/v1/waitpoints/tokens/{theirs_token}").json()["status"] == "WAITING"
        r = c.post("/api/v1/waitpoints/tokens/waitpoint_nope/callback/sig", json=1)
        assert r.status_code == 401  # the signature is checked first: ids are not probed
    assert stack.run(theirs)["status"] != "CANCELED"  # untouched by the other tenant's calls


def create_token_for(s: Stack) -> str:
    with s.client() as c:
        r = c.post("/api/v1/waitpoints/tokens", json={})
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def test_oversize_payload_and_request_are_413(lonely: Stack) -> None:
    before = _count_runs(lonely)
    with lonely.client() as c:
        big = "x" * (3 * 1024 * 1024 + 10)
        r = c.post("/api/v1/tasks/manual/trigger", json={"payload": big})
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        huge = b'{"payload": "' + b"y" * (10 * 1024 * 1024 + 10) + b'"}'
        r = c.post("/api/v1/tasks/manual/trigger", content=huge, headers={"content-type": "application/json"})
        assert r.status_code == 413
    assert _count_runs(lonely) == before


def test_stale_snapshot_is_409_with_the_latest(lonely: Stack) -> None:
    run_id = lonely.trigger("manual", "stale")
    with lonely.worker() as w:
        items = []
        deadline = time.monotonic() + 10
        while not any(i["run"]["id"] == run_id for i in items):
            items = dequeue(w, wait_ms=500)
            assert time.monotonic() < deadline
        item = next(i for i in items if i["run"]["id"] == run_id)
        start = w.post(f"{W}/runs/{run_id}/snapshots/{item['snapshot']['id']}/attempts/start")
        assert start.status_code == 200
        again = w.post(f"{W}/runs/{run_id}/snapshots/{item['snapshot']['id']}/attempts/start")
        assert again.status_code == 409
        latest = again.json()["error"]["latestSnapshot"]
        assert latest["executionStatus"] == "EXECUTING" and latest["id"] == start.json()["snapshot"]["id"]
        bad = w.post(f"{W}/runs/{run_id}/snapshots/{latest['id']}/attempts/complete", json={"ok": "maybe"})
        assert bad.status_code == 400
        for other in items:
            if other["run"]["id"] != run_id:
                w.post(f"{W}/runs/{other['run']['id']}/snapshots/{other['snapshot']['id']}/attempts/start")


def test_batch_start_and_complete_report_each_item(stack: Stack, lonely: Stack) -> None:
    ids = [lonely.trigger("manual", i) for i in range(3)]
    with lonely.worker() as w:
        items: dict[str, Any] = {}
        deadline = time.monotonic() + 10
        while not set(ids) <= set(items):
            items.update({i["run"]["id"]: i for i in dequeue(w, wait_ms=500)})
            assert time.monotonic() < deadline
        refs = [{"runId": i, "snapshotId": items[i]["snapshot"]["id"]} for i in ids]
        foreign = stack.trigger("echo", "not yours")
        started = w.post(f"{W}/attempts/start", json={"items": [*refs, {"runId": foreign, "snapshotId": "s"}]}).json()
        results = started["results"]
        assert [r["ok"] for r in results] == [True, True, True, False]
        assert results[3]["status"] == 404 and results[3]["error"]["code"] == "not_found"
        again = w.post(f"{W}/attempts/start", json={"items": refs[:1]}).json()["results"][0]
        assert again["status"] == 409 and again["error"]["latestSnapshot"]["executionStatus"] == "EXECUTING"
        done = w.post(f"{W}/attempts/complete", json={"items": [
            {"runId": r["run"]["id"], "snapshotId": r["snapshot"]["id"], "ok": True, "output": r["payload"]}
            for r in results[:3]]}).json()["results"]
        assert [d["action"] for d in done] == ["finished"] * 3
        assert w.post(f"{W}/attempts/complete", json={"items": []}).status_code == 400
    assert [lonely.run(i)["output"] for i in ids] == [0, 1, 2]


def test_dequeue_can_start_the_attempts_in_the_same_request(lonely: Stack) -> None:
    run_id = lonely.trigger("manual", "at once")
    with lonely.worker() as w:
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + 10
        while not any(i["run"]["id"] == run_id for i in got):
            r = w.post(f"{W}/dequeue", json={"maxRuns": 10, "waitMs": 500, "startAttempts": True})
            got = r.json()["runs"]
            for other in got:
                if other["run"]["id"] != run_id and other["attempt"]["ok"]:
                    a = other["attempt"]
                    w.post(f"{W}/runs/{a['run']['id']}/snapshots/{a['snapshot']['id']}/attempts/complete",
                           json={"ok": True, "output": None})
            assert time.monotonic() < deadline
        attempt = next(i for i in got if i["run"]["id"] == run_id)["attempt"]
        assert attempt["ok"] and attempt["attemptNumber"] == 1 and attempt["payload"] == "at once"
        assert attempt["snapshot"]["executionStatus"] == "EXECUTING"
        assert lonely.run(run_id)["status"] == "EXECUTING"
        done = w.post(f"{W}/runs/{run_id}/snapshots/{attempt['snapshot']['id']}/attempts/complete",
                      json={"ok": True, "output": 42})
        assert done.json()["action"] == "finished"
    assert lonely.run(run_id)["output"] == 42


def test_runs_filtered_by_creation_time(lonely: Stack) -> None:
    from datetime import UTC, datetime, timedelta

    run_id = lonely.trigger("manual", {"when": "now"})
    now = datetime.now(UTC)
    with lonely.client() as c:
        def ids(**window: str) -> list[str]:
            r = c.get("/api/v1/runs", params={f"filter[createdAt][{k}]": v for k, v in window.items()})
            assert r.status_code == 200, r.text
            return [run["id"] for run in r.json()["data"]]

        hour_ago, in_an_hour = (now - timedelta(hours=1)).isoformat(), (now + timedelta(hours=1)).isoformat()
        assert run_id in ids(**{"from": hour_ago})
        assert run_id in ids(**{"from": hour_ago, "to": in_an_hour})
        assert run_id not in ids(**{"from": in_an_hour})
        assert run_id not in ids(to=(now - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%S"))  # naive: UTC
        r = c.get("/api/v1/runs", params={"filter[createdAt][from]": "last tuesday"})
        assert r.status_code == 400 and "filter[createdAt][from]" in r.json()["error"]["message"]
