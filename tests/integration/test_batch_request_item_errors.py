"""A one-request batch (`POST /api/v1/tasks/batch`, `/api/v2/tasks/batch`) whose debounced item fails
after the plain items' runs were committed (its run's lock busy, its key changing hands, an outage
then): that item fails alone, answered in the request's `errors`; the others' runs stand and are
answered as made. Before, the request failed (503/409) with the plain runs made all the same, so
its retry (without an idempotency key) made them twice."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from .conftest import Harness

DEBOUNCED = {"debounce": {"key": "k", "delay": "10s"}}


async def hello_runs(h: Harness) -> list[Any]:
    return list(await h.engine.list_runs(h.env.env_id, tasks=["hello"], limit=100, light=True))


async def debounced_run_with_a_busy_lock(h: Harness, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Any]:
    """A DELAYED debounced run of key "k", whose lock stays busy for whoever joins it: the join of a
    batch's debounced item fails after the batch's plain runs were made. The join, to put back."""
    from run_engine.engine import Debounce, TriggerRequest
    from run_engine.errors import LockTimeoutError

    debounced = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello",
                                                      debounce=Debounce("k", 10, "leading", None)))
    delayed_runs = h.engine.systems.delayed_runs
    join = delayed_runs.debounce

    async def busy(run_id: str, *args: Any, **kwargs: Any) -> Any:
        raise LockTimeoutError((run_id,), 15.0, 10)

    monkeypatch.setattr(delayed_runs, "debounce", busy)
    return debounced.id, join


def three_items() -> dict[str, Any]:
    return {"items": [{"task": "hello", "payload": {"i": 0}},
                      {"task": "hello", "payload": {"i": 1}, "options": DEBOUNCED},
                      {"task": "hello", "payload": {"i": 2}}]}


@pytest.mark.parametrize("version", ["v1", "v2"])
async def test_a_debounced_item_failing_late_fails_its_own_item_only(
        h: Harness, api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    """Without an idempotency key nothing can make the item later: it is kept with the batch as a
    failed item (`processing.errors`), and the batch completes with its runs."""
    debounced, _ = await debounced_run_with_a_busy_lock(h, monkeypatch)
    sent = await api.post(f"/api/{version}/tasks/batch", json=three_items())
    assert sent.status_code == 200, sent.text
    answer = sent.json()
    assert [(e["index"], e["taskIdentifier"], e["errorCode"]) for e in answer["errors"]] == [
        (1, "hello", "lock_timeout")]
    assert answer["errors"][0]["error"]
    made = [r.id for r in await hello_runs(h) if r.id != debounced]
    assert len(made) == 2
    if version == "v1":  # the other items' runs, in their order; the failed item has none
        assert [r["taskIdentifier"] for r in answer["runs"]] == ["hello", "hello"]
        assert {r["id"] for r in answer["runs"]} == set(made)
        payloads = [(await h.engine.get_run(r["id"])).payload["i"] for r in answer["runs"]]  # type: ignore[union-attr]
        assert payloads == [0, 2]
    else:
        assert answer["runCount"] == 3 and answer["isCached"] is False
    got = (await api.get(f"/api/v2/batches/{answer['id']}")).json()
    assert sorted(got["runs"]) == sorted(made) and got["runCount"] == 3
    assert [(e["index"], e["taskIdentifier"], e["errorCode"]) for e in got["processing"]["errors"]] == [
        (1, "hello", "lock_timeout")]


async def test_a_keyed_batch_s_late_failure_is_made_by_its_retry(
        h: Harness, api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """With an idempotency key the failure is of the moment, as a streamed batch's: it is not kept,
    and the retry with the same key joins the debounced run, the other items deduplicated."""
    debounced, join = await debounced_run_with_a_busy_lock(h, monkeypatch)
    headers = {"idempotency-key": "late"}
    sent = await api.post("/api/v1/tasks/batch", json=three_items(), headers=headers)
    assert sent.status_code == 200, sent.text
    answer = sent.json()
    assert [(e["index"], e["errorCode"]) for e in answer["errors"]] == [(1, "lock_timeout")]
    assert len(answer["runs"]) == 2 and len(await hello_runs(h)) == 3
    got = (await api.get(f"/api/v2/batches/{answer['id']}")).json()
    assert got["processing"]["errors"] == []
    monkeypatch.setattr(h.engine.systems.delayed_runs, "debounce", join)
    again = await api.post("/api/v1/tasks/batch", json=three_items(), headers=headers)
    assert again.status_code == 200, again.text
    retried = again.json()
    assert retried["id"] == answer["id"] and "errors" not in retried
    assert [r["id"] for r in retried["runs"]] == [answer["runs"][0]["id"], debounced, answer["runs"][1]["id"]]
    assert len(await hello_runs(h)) == 3  # nothing made twice


async def test_a_batch_none_of_whose_items_was_made_fails_as_before(
        h: Harness, api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """No other item to answer: the request gets the item's error, as a trigger would."""
    await debounced_run_with_a_busy_lock(h, monkeypatch)
    sent = await api.post("/api/v2/tasks/batch", json={"items": [
        {"task": "hello", "payload": 1, "options": DEBOUNCED}]}, headers={"idempotency-key": "none"})
    assert sent.status_code == 503 and sent.json()["error"]["code"] == "lock_timeout", sent.text


@pytest.mark.parametrize("key", [None, "one-request"])
async def test_a_one_request_batch_takes_no_streamed_items(h: Harness, api: httpx.AsyncClient, key: str | None) -> None:
    """The two-phase batch's item stream (`POST /api/v3/batches/{id}/items`) took a one-request
    batch's id: each line made one more run of that batch (a batch of 2 read 4 runs), since such a
    batch keeps no sent indexes. Only a batch opened for its items takes them (404 otherwise)."""
    headers = {"idempotency-key": key} if key else {}
    sent = await api.post("/api/v1/tasks/batch", headers=headers, json={"items": [
        {"task": "hello", "payload": {"i": 0}}, {"task": "hello", "payload": {"i": 1}}]})
    assert sent.status_code == 200, sent.text
    batch = sent.json()["id"]
    lines = '{"index": 0, "task": "hello", "payload": {"x": 1}}\n{"index": 1, "task": "hello", "payload": {"x": 2}}\n'
    more = await api.post(f"/api/v3/batches/{batch}/items", content=lines,
                          headers={"Content-Type": "application/x-ndjson"})
    assert more.status_code == 404, more.text
    got = await api.get(f"/api/v1/batches/{batch}")
    assert got.json()["runCount"] == 2 and len(got.json()["runs"]) == 2
