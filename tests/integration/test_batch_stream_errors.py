"""A streamed batch (`POST /api/v3/batches/{batchId}/items`) whose lines are not all valid items: one
bad line (malformed JSON, past the line's bound, a bad shape, an item refused for its input) fails
its own item only; the others are made and run, the failure is answered per line and kept with the
batch, which seals and completes without it."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import orjson
import pytest

from .conftest import Harness

NDJSON = {"Content-Type": "application/x-ndjson"}


def line(index: int, task: str = "hello", **fields: Any) -> bytes:
    return orjson.dumps({"index": index, "task": task, "payload": {"i": index}} | fields)


async def opened(api: httpx.AsyncClient, run_count: int, **fields: Any) -> str:
    made = await api.post("/api/v3/batches", json={"runCount": run_count} | fields)
    assert made.status_code == 200, made.text
    batch_id: str = made.json()["id"]
    return batch_id


async def run_to_completion(h: Harness, run_ids: list[str]) -> None:
    got = {d.run.id: d for d in await h.engine.dequeue(h.env.worker_group_id, 10)}
    for run_id in run_ids:
        started = await h.engine.start_attempt(run_id, got[run_id].snapshot.id)
        await h.engine.complete_attempt(run_id, started.snapshot.id, ok=True, output={"done": run_id})


async def test_a_bad_line_fails_its_own_item_and_the_others_run(h: Harness, api: httpx.AsyncClient,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from run_engine.api import batch_lines

    monkeypatch.setattr(batch_lines, "MAX_CONTAINERS", 100)
    batch_id = await opened(api, 6)
    body = b"\n".join([
        line(0),
        b'{"index": 1, "task": "hello", "payload": {"i": 1,,}}',  # malformed JSON
        line(2),
        line(3, task=""),  # a bad shape
        line(4, payload=[[] for _ in range(201)]),  # past the line's bound: refused before it is parsed
        line(5, payload="\u0000"),  # cannot be stored
    ])
    sent = await api.post(f"/api/v3/batches/{batch_id}/items", content=body, headers=NDJSON)
    assert sent.status_code == 200, sent.text
    answer = sent.json()
    assert (answer["itemsAccepted"], answer["itemsDeduplicated"], answer["sealed"]) == (2, 0, True)
    assert [(e["line"], e.get("index"), e["errorCode"]) for e in answer["errors"]] == [
        (2, 1, "invalid_input"), (4, 3, "invalid_input"), (5, 4, "payload_too_large"), (6, 5, "invalid_input")]
    assert "malformed JSON" in answer["errors"][0]["error"] and answer["errors"][0]["taskIdentifier"] == "hello"

    got = (await api.get(f"/api/v2/batches/{batch_id}")).json()
    assert got["status"] == "PENDING" and got["runCount"] == 6 and len(got["runs"]) == 2
    assert [(e["index"], e["taskIdentifier"], e["errorCode"]) for e in got["processing"]["errors"]] == [
        (1, "hello", "invalid_input"), (3, "", "invalid_input"), (4, "hello", "payload_too_large"),
        (5, "hello", "invalid_input")]
    assert all(e["error"] for e in got["processing"]["errors"])
    await run_to_completion(h, got["runs"])
    done = (await api.get(f"/api/v2/batches/{batch_id}")).json()
    assert done["status"] == "COMPLETED"  # the failed items count as finished
    payloads = sorted([(await h.engine.get_run(r)).payload["i"] for r in got["runs"]])  # type: ignore[union-attr]
    assert payloads == [0, 2]


async def test_a_retried_stream_changes_nothing_and_answers_its_failures_again(
        h: Harness, api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """The process died after the runs were made but before the items were noted: the retry (the
    SDK sends the same body again) makes no run twice and finds the same failures, noted once."""
    batch_id = await opened(api, 3, idempotencyKey="retried")
    body = b"\n".join([line(0), b'{"index": 1, "task": "hello", "payload": nope}', line(2)])
    note = h.engine.note_batch_items

    async def died(*args: Any, **kwargs: Any) -> int:
        raise RuntimeError("the process died here")

    monkeypatch.setattr(h.engine, "note_batch_items", died)
    with pytest.raises(RuntimeError, match="died"):
        await api.post(f"/api/v3/batches/{batch_id}/items", content=body, headers=NDJSON)
    monkeypatch.setattr(h.engine, "note_batch_items", note)
    assert (await api.get(f"/api/v2/batches/{batch_id}")).json()["status"] == "PROCESSING"
    assert await opened(api, 3, idempotencyKey="retried") == batch_id  # the SDK's retry opens it again
    for _ in range(2):
        again = (await api.post(f"/api/v3/batches/{batch_id}/items", content=body, headers=NDJSON)).json()
        assert (again["itemsAccepted"], again["itemsDeduplicated"], again["sealed"]) == (0, 2, True)
        assert [(e["line"], e["index"]) for e in again["errors"]] == [(2, 1)]
    got = (await api.get(f"/api/v2/batches/{batch_id}")).json()
    assert len(got["runs"]) == 2 and [e["index"] for e in got["processing"]["errors"]] == [1]
    # the item sent again, well formed: its index failed already, as an index made is made once
    fixed = (await api.post(f"/api/v3/batches/{batch_id}/items", content=line(1), headers=NDJSON)).json()
    assert (fixed["itemsAccepted"], fixed["itemsDeduplicated"], "errors" in fixed) == (0, 1, False)


async def test_a_line_that_names_no_index_fails_no_item(h: Harness, api: httpx.AsyncClient) -> None:
    """Nothing says which item a line that cannot be read was meant to be: it is answered by its
    line number, the others are made, and the batch waits for the missing index."""
    batch_id = await opened(api, 4)
    body = b"\n".join([line(0), b"{nope", line(2), line(7)])
    sent = (await api.post(f"/api/v3/batches/{batch_id}/items", content=body, headers=NDJSON)).json()
    assert (sent["itemsAccepted"], sent["sealed"], sent["enqueuedCount"], sent["expectedCount"]) == (2, False, 2, 4)
    assert [(e["line"], "index" in e) for e in sent["errors"]] == [(2, False), (4, False)]
    assert "runCount 4" in sent["errors"][1]["error"]
    got = (await api.get(f"/api/v2/batches/{batch_id}")).json()
    assert got["status"] == "PROCESSING" and got["processing"]["errors"] == []
    rest = await api.post(f"/api/v3/batches/{batch_id}/items", content=line(1) + b"\n" + line(3), headers=NDJSON)
    assert rest.json()["sealed"] is True and rest.json()["itemsAccepted"] == 2
    # a body none of whose lines is an item is refused whole, as before
    for garbage in (b"{nope", b"[1, 2]\nnull", line(9)):
        refused = await api.post(f"/api/v3/batches/{batch_id}/items", content=garbage, headers=NDJSON)
        assert refused.status_code == 400 and "line 1" in refused.json()["error"]["message"], garbage


async def test_an_item_refused_for_its_input_fails_alone(h: Harness, api: httpx.AsyncClient) -> None:
    """Refusals after the line was read: a payload text that is not JSON, an upload that is not
    there, a parent run of no such id, a worker group that does not exist (the engine's own)."""
    batch_id = await opened(api, 5)
    body = b"\n".join([
        line(0),
        line(1, payload="{not json", options={"payloadType": "application/json"}),
        line(2, payload="uploads/none/x.json", options={"payloadType": "application/store"}),
        line(3, options={"parentRunId": "run_aaaaaaaaaaaaaaaaaaaaaaaa"}),
        line(4, options={"workerGroup": "nope"}),
    ])
    sent = await api.post(f"/api/v3/batches/{batch_id}/items", content=body, headers=NDJSON)
    assert sent.status_code == 200, sent.text
    answer = sent.json()
    assert (answer["itemsAccepted"], answer["sealed"]) == (1, True)
    assert [(e["index"], e["errorCode"]) for e in answer["errors"]] == [
        (1, "invalid_input"), (2, "invalid_input"), (3, "invalid_input"), (4, "invalid_input")]
    messages = [e["error"] for e in answer["errors"]]
    assert messages[0].startswith("items.1.payload") and messages[1].startswith("items.2.payload")
    assert "parentRunId" in messages[2] and messages[3].startswith("options.workerGroup")
    got = (await api.get(f"/api/v2/batches/{batch_id}")).json()
    assert len(got["runs"]) == 1 and [e["index"] for e in got["processing"]["errors"]] == [1, 2, 3, 4]


async def test_a_batch_whose_runs_are_waited_on_completes_without_its_failed_items(
        h: Harness, api: httpx.AsyncClient) -> None:
    """Runs a parent waits on are counted into their batch as they finish: the batch's own record
    completes (its runs may then be deleted with the retention) once the runs it has finished, its
    failed item counted as finished."""
    from run_engine.engine import TriggerRequest

    parent = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1)
    await h.engine.start_attempt(parent.id, d.snapshot.id)
    batch_id = await opened(api, 3)
    waited = {"parentRunId": parent.id, "resumeParentOnCompletion": True}
    body = b"\n".join([line(0, options=waited), line(1, task="", options=waited), line(2, options=waited)])
    sent = (await api.post(f"/api/v3/batches/{batch_id}/items", content=body, headers=NDJSON)).json()
    assert sent["sealed"] is True and sent["itemsAccepted"] == 2
    runs = (await api.get(f"/api/v2/batches/{batch_id}")).json()["runs"]
    await run_to_completion(h, runs)
    async with h.engine.resources.repo.waitpoints.pool.connection() as conn:
        cur = await conn.execute("SELECT status FROM batch_task_run WHERE id = %s", (batch_id,))
        assert await cur.fetchone() == ("COMPLETED",)


async def test_a_debounced_item_that_fails_after_the_others_were_made_fails_for_the_moment(
        h: Harness, api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain items' runs are committed before a debounced item joins its run: its run's lock
    busy then fails that item only, not the request; it is not noted, so the stream's retry joins
    it (before, the request answered 503 after the plain runs were made)."""
    from run_engine.engine import Debounce, TriggerRequest
    from run_engine.errors import LockTimeoutError

    debounced = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello",
                                                      debounce=Debounce("k", 10, "leading", None)))
    delayed_runs = h.engine.systems.delayed_runs
    join = delayed_runs.debounce

    async def busy(run_id: str, *args: Any, **kwargs: Any) -> Any:
        raise LockTimeoutError((run_id,), 15.0, 10)

    monkeypatch.setattr(delayed_runs, "debounce", busy)
    batch_id = await opened(api, 2)
    body = line(0) + b"\n" + line(1, options={"debounce": {"key": "k", "delay": "10s"}})
    sent = await api.post(f"/api/v3/batches/{batch_id}/items", content=body, headers=NDJSON)
    assert sent.status_code == 200, sent.text
    answer = sent.json()
    assert (answer["itemsAccepted"], answer["sealed"], answer["enqueuedCount"]) == (1, False, 1)
    assert [(e["line"], e["index"], e["errorCode"]) for e in answer["errors"]] == [(2, 1, "lock_timeout")]
    assert (await api.get(f"/api/v2/batches/{batch_id}")).json()["processing"]["errors"] == []
    monkeypatch.setattr(delayed_runs, "debounce", join)
    again = (await api.post(f"/api/v3/batches/{batch_id}/items", content=body, headers=NDJSON)).json()
    assert (again["itemsAccepted"], again["itemsDeduplicated"], again["sealed"], "errors" in again) == (
        0, 2, True, False)
    runs = await h.engine.list_runs(h.env.env_id, tasks=["hello"], limit=10, light=True)
    assert len(runs) == 2 and debounced.id in {r.id for r in runs}  # the plain run, once; the joined one


async def stored(h: Harness, batch_id: str) -> tuple[str, int, int, bool]:
    """The batch's own row: its status, items_failed, completed_count, and whether completed_at is set."""
    async with h.engine.resources.repo.waitpoints.pool.connection() as conn:
        cur = await conn.execute("SELECT status, items_failed, completed_count, completed_at IS NOT NULL "
                                 "FROM batch_task_run WHERE id = %s", (batch_id,))
        row = await cur.fetchone()
    assert row is not None
    return row[0], row[1], row[2], row[3]


@pytest.mark.parametrize("how", ["a later stream", "a retry after dying before the note"])
async def test_an_item_failed_after_the_batch_s_runs_finished_completes_its_stored_row(
        h: Harness, api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """The batch's stored row completes once its runs have finished and its failed items are
    counted, whichever comes first: its failed item noted after its (waited) runs had finished, by a
    later stream or by the retry of a stream whose process died before the note. Before, items_failed
    was counted after the runs' finishes had been, and the row stayed PENDING for good while
    GET /api/v2/batches answered COMPLETED."""
    from run_engine.engine import TriggerRequest

    parent = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1)
    await h.engine.start_attempt(parent.id, d.snapshot.id)
    batch_id = await opened(api, 3)
    waited = {"parentRunId": parent.id, "resumeParentOnCompletion": True}
    good = line(0, options=waited) + b"\n" + line(2, options=waited)
    bad = line(1, task="", options=waited)
    if how == "a later stream":
        sent = (await api.post(f"/api/v3/batches/{batch_id}/items", content=good, headers=NDJSON)).json()
        assert sent["itemsAccepted"] == 2 and sent["sealed"] is False
    else:
        note = h.engine.note_batch_items

        async def died(*args: Any, **kwargs: Any) -> int:
            raise RuntimeError("the process died here")

        monkeypatch.setattr(h.engine, "note_batch_items", died)
        with pytest.raises(RuntimeError, match="died"):
            await api.post(f"/api/v3/batches/{batch_id}/items", content=good + b"\n" + bad, headers=NDJSON)
        monkeypatch.setattr(h.engine, "note_batch_items", note)
    await run_to_completion(h, (await api.get(f"/api/v2/batches/{batch_id}")).json()["runs"])
    assert await stored(h, batch_id) == ("PENDING", 0, 2, False)  # one item not known to have failed yet
    body = bad if how == "a later stream" else good + b"\n" + bad
    sent = (await api.post(f"/api/v3/batches/{batch_id}/items", content=body, headers=NDJSON)).json()
    assert sent["sealed"] is True and [e["index"] for e in sent["errors"]] == [1]
    assert (await api.get(f"/api/v2/batches/{batch_id}")).json()["status"] == "COMPLETED"
    assert await stored(h, batch_id) == ("COMPLETED", 1, 2, True)


async def test_a_batch_all_of_whose_items_failed_is_stored_completed(h: Harness, api: httpx.AsyncClient) -> None:
    """No run to finish: the row completes when its failures are noted (it stayed PENDING)."""
    batch_id = await opened(api, 2)
    sent = (await api.post(f"/api/v3/batches/{batch_id}/items", content=line(0, task="") + b"\n{nope",
                           headers=NDJSON)).json()
    assert sent["itemsAccepted"] == 0 and sent["sealed"] is False and [e.get("index") for e in sent["errors"]] == [
        0, None]
    assert await stored(h, batch_id) == ("PENDING", 1, 0, False)
    sent = (await api.post(f"/api/v3/batches/{batch_id}/items", content=line(1, task=""), headers=NDJSON)).json()
    assert sent["sealed"] is True
    assert (await api.get(f"/api/v2/batches/{batch_id}")).json()["status"] == "COMPLETED"
    assert await stored(h, batch_id) == ("COMPLETED", 2, 0, True)


async def test_a_body_of_more_objects_and_arrays_than_a_json_body_may_hold_is_refused_whole(
        h: Harness, api: httpx.AsyncClient) -> None:
    """Each line under its own bound, the body together past the bound of any JSON body (the same
    items sent as one JSON batch are refused): 413 before a line is decoded, nothing triggered."""
    from run_engine.api.http import MAX_BODY_CONTAINERS

    per_line = MAX_BODY_CONTAINERS // 1000 + 1
    body = b"\n".join(line(i, payload=[[] for _ in range(per_line)]) for i in range(1000))
    batch_id = await opened(api, 1000)
    sent = await api.post(f"/api/v3/batches/{batch_id}/items", content=body, headers=NDJSON)
    assert sent.status_code == 413, sent.text
    error = sent.json()["error"]
    assert error["code"] == "payload_too_large" and f"at most {MAX_BODY_CONTAINERS}" in error["message"]
    got = (await api.get(f"/api/v2/batches/{batch_id}")).json()
    assert got["runs"] == [] and got["processing"]["errors"] == []
    # the same items in bodies under the bound are made
    for half in (body.split(b"\n")[:500], body.split(b"\n")[500:]):
        sent = await api.post(f"/api/v3/batches/{batch_id}/items", content=b"\n".join(half), headers=NDJSON)
        assert sent.status_code == 200 and sent.json()["itemsAccepted"] == 500, sent.text
    assert sent.json()["sealed"] is True


async def test_a_stream_cut_off_by_its_client_is_a_400_and_its_retry_makes_the_items(
        h: Harness, api: httpx.AsyncClient, caplog: pytest.LogCaptureFixture) -> None:
    """The client goes half way through its body (a timeout, a crash): the request is answered 400
    in the API's error shape (to nobody), not a 500 logged with its traceback; nothing is
    triggered, and the SDK's retry of the whole stream makes every item."""
    from run_engine.api.app import create_app
    from run_engine.api.context import ApiContext

    batch_id = await opened(api, 2)
    body = line(0) + b"\n" + line(1)
    path = f"/api/v3/batches/{batch_id}/items"
    messages: list[dict[str, Any]] = [{"type": "http.request", "body": body[:30], "more_body": True},
                                      {"type": "http.disconnect"}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    ctx: ApiContext = api._transport.app.state.ctx  # type: ignore[attr-defined]
    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"authorization", f"Bearer {h.env.api_key}".encode()),
                         (b"content-type", b"application/x-ndjson")],
             "scheme": "http", "server": ("t", 80), "client": ("c", 1), "http_version": "1.1", "root_path": ""}
    with caplog.at_level(logging.WARNING):
        await create_app(ctx)(scope, receive, send)
    assert sent[0]["status"] == 400
    assert orjson.loads(sent[1]["body"])["error"]["code"] == "invalid_input"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert (await api.get(f"/api/v2/batches/{batch_id}")).json()["runs"] == []
    retried = (await api.post(path, content=body, headers=NDJSON)).json()
    assert (retried["itemsAccepted"], retried["sealed"]) == (2, True)
