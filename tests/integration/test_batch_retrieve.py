"""`GET /api/v2/batches/{batchId}`, what Trigger.dev's SDK's `batch.retrieve` reads: a batch made in
one request, a two-phase batch while its items are sent and once sealed, and nobody else's."""

from __future__ import annotations

import httpx
import orjson

from run_engine.tenancy import ensure_environment

from .conftest import Harness

NDJSON = {"Content-Type": "application/x-ndjson"}


async def test_a_batch_made_in_one_request(h: Harness, api: httpx.AsyncClient) -> None:
    made = await api.post("/api/v1/tasks/batch", json={"items": [{"task": "hello", "payload": {"i": i}}
                                                                 for i in range(3)]})
    assert made.status_code == 200, made.text
    batch_id = made.json()["id"]
    got = (await api.get(f"/api/v2/batches/{batch_id}")).json()
    assert got["id"] == batch_id and got["status"] == "PENDING" and got["runCount"] == 3
    assert sorted(got["runs"]) == sorted(r["id"] for r in made.json()["runs"])
    assert got["processing"] == {"errors": []} and "idempotencyKey" not in got
    assert got["createdAt"].endswith("Z") and got["updatedAt"] >= got["createdAt"]
    assert (await api.get(f"/api/v1/batches/{batch_id}")).json()["runs"] == got["runs"]  # the same order

    for run_id in got["runs"]:
        await h.engine.cancel(run_id)
    assert (await api.get(f"/api/v2/batches/{batch_id}")).json()["status"] == "COMPLETED"  # every run final


async def test_a_two_phase_batch_is_processing_until_every_item_was_sent(h: Harness, api: httpx.AsyncClient) -> None:
    opened = (await api.post("/api/v3/batches", json={"runCount": 3, "idempotencyKey": "k-1"})).json()
    empty = (await api.get(f"/api/v2/batches/{opened['id']}")).json()
    assert empty["status"] == "PROCESSING" and empty["runs"] == [] and empty["runCount"] == 3
    assert empty["idempotencyKey"] == "k-1"
    assert (await api.get(f"/api/v1/batches/{opened['id']}")).status_code == 404  # v1: a batch is its runs

    def items(*indexes: int) -> bytes:
        return b"\n".join(orjson.dumps({"index": i, "task": "hello", "payload": {"i": i}}) for i in indexes)

    await api.post(f"/api/v3/batches/{opened['id']}/items", content=items(0), headers=NDJSON)
    part = (await api.get(f"/api/v2/batches/{opened['id']}")).json()
    assert part["status"] == "PROCESSING" and len(part["runs"]) == 1
    elsewhere = (await api.post("/api/v1/tasks/hello/trigger",
                                json={"payload": 1, "options": {"idempotencyKey": "other-run"}})).json()["id"]
    joined = orjson.dumps({"index": 2, "task": "hello", "payload": 2, "options": {"idempotencyKey": "other-run"}})
    await api.post(f"/api/v3/batches/{opened['id']}/items", content=items(1) + b"\n" + joined, headers=NDJSON)
    sealed = (await api.get(f"/api/v2/batches/{opened['id']}")).json()
    assert sealed["status"] == "PENDING" and len(sealed["runs"]) == 2 and elsewhere not in sealed["runs"]
    assert sealed["runCount"] == 3


async def test_a_batch_is_its_environments_only(h: Harness, api: httpx.AsyncClient) -> None:
    opened = (await api.post("/api/v3/batches", json={"runCount": 2})).json()
    other = await ensure_environment(h.engine.resources.repo, secret="test-secret", org="other-org", project="p",
                                     env="dev")
    theirs = await api.get(f"/api/v2/batches/{opened['id']}", headers={"Authorization": f"Bearer {other.api_key}"})
    assert theirs.status_code == 404
    for missing in ("batch_aaaaaaaaaaaaaaaaaaaaaaaa", "nope", "batch_%00"):
        assert (await api.get(f"/api/v2/batches/{missing}")).status_code in (400, 404), missing
    scoped = (await api.post("/api/v1/auth/public-tokens", json={"scopes": ["read:batch:batch_other"]})).json()
    denied = await api.get(f"/api/v2/batches/{opened['id']}", headers={"Authorization": f"Bearer {scoped['token']}"})
    assert denied.status_code == 403
    allowed = (await api.post("/api/v1/auth/public-tokens", json={"scopes": [f"read:batch:{opened['id']}"]})).json()
    assert (await api.get(f"/api/v2/batches/{opened['id']}",
                          headers={"Authorization": f"Bearer {allowed['token']}"})).status_code == 200


async def test_a_batch_whose_items_all_joined_other_runs_is_not_processing(h: Harness, api: httpx.AsyncClient) -> None:
    existing = (await api.post("/api/v1/tasks/hello/trigger",
                               json={"payload": 1, "options": {"idempotencyKey": "taken"}})).json()["id"]
    made = (await api.post("/api/v1/tasks/batch", json={"items": [
        {"task": "hello", "payload": 2, "options": {"idempotencyKey": "taken"}}]})).json()
    assert [r["id"] for r in made["runs"]] == [existing]
    got = (await api.get(f"/api/v2/batches/{made['id']}")).json()
    assert got["status"] != "PROCESSING" and got["runs"] == [] and got["runCount"] == 1


async def test_a_two_phase_batch_never_made_whole_is_aborted_after_the_grace(
        h: Harness, api: httpx.AsyncClient) -> None:
    """A client that opened a batch and stopped sending: past the grace the sweep gives a batch,
    the batch is ABORTED (a poller waiting for it to leave PROCESSING stops); items sent later
    still make their runs, and once every item is in it reads as any batch."""
    opened = (await api.post("/api/v3/batches", json={"runCount": 2})).json()

    def item(i: int) -> bytes:
        return orjson.dumps({"index": i, "task": "hello", "payload": {"i": i}})

    await api.post(f"/api/v3/batches/{opened['id']}/items", content=item(0), headers=NDJSON)
    h.clock.advance(h.engine.settings.batch_creation_grace_s - 5)
    assert (await api.get(f"/api/v2/batches/{opened['id']}")).json()["status"] == "PROCESSING"
    h.clock.advance(10)
    assert (await api.get(f"/api/v2/batches/{opened['id']}")).json()["status"] == "ABORTED"
    await api.post(f"/api/v3/batches/{opened['id']}/items", content=item(1), headers=NDJSON)
    whole = (await api.get(f"/api/v2/batches/{opened['id']}")).json()
    assert whole["status"] == "PENDING" and len(whole["runs"]) == 2


async def test_a_runs_wait_batch_takes_no_items_and_an_index_makes_one_run(h: Harness, api: httpx.AsyncClient) -> None:
    """Items streamed into a run's batchTriggerAndWait batch would finish it on runs not its own
    (its parent resumed while its children were still queued): 404. In a two-phase batch an index
    sent again (another task, a key whose TTL passed) makes no second run."""
    from run_engine.engine import TriggerRequest

    parent = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1)
    started = await h.engine.start_attempt(parent.id, d.snapshot.id)
    ids, _ = await h.engine.trigger_and_wait(parent.id, started.snapshot.id, 0, [
        TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=i) for i in range(2)], batch=True)
    child = await h.engine.get_run(ids[0])
    assert child is not None and child.batch_id is not None
    injected = await api.post(f"/api/v3/batches/{child.batch_id}/items", headers=NDJSON,
                              content=orjson.dumps({"index": 0, "task": "hello", "payload": "x"}))
    assert injected.status_code == 404

    opened = (await api.post("/api/v3/batches", json={"runCount": 2})).json()
    url = f"/api/v3/batches/{opened['id']}/items"
    first = (await api.post(url, headers=NDJSON, content=orjson.dumps(
        {"index": 0, "task": "hello", "payload": 1, "options": {"idempotencyKeyTTL": "1s"}}))).json()
    assert first["itemsAccepted"] == 1 and not first["sealed"]
    h.clock.advance(5)
    again = (await api.post(url, headers=NDJSON, content=b"\n".join([
        orjson.dumps({"index": 0, "task": "other", "payload": 2}),
        orjson.dumps({"index": 1, "task": "hello", "payload": 4})]))).json()
    assert again["itemsAccepted"] == 1 and again["itemsDeduplicated"] == 1 and again["sealed"]
    # each index again (a key whose TTL passed, another task), as a retried stream sends them
    third = (await api.post(url, headers=NDJSON, content=b"\n".join([
        orjson.dumps({"index": 0, "task": "hello", "payload": 3, "options": {"idempotencyKeyTTL": "1s"}}),
        orjson.dumps({"index": 1, "task": "other", "payload": 5})]))).json()
    assert third["itemsAccepted"] == 0 and third["itemsDeduplicated"] == 2 and third["sealed"]
    # more lines than the batch has runs: refused before any is parsed
    over = await api.post(url, headers=NDJSON, content=b"\n".join([
        orjson.dumps({"index": 0, "task": "hello"}), orjson.dumps({"index": 1, "task": "hello"}),
        orjson.dumps({"index": 0, "task": "hello"})]))
    assert over.status_code == 400 and "runCount 2" in over.json()["error"]["message"]
    got = (await api.get(f"/api/v2/batches/{opened['id']}")).json()
    assert got["runCount"] == 2 and len(got["runs"]) == 2
