"""A batch's idempotency key: a retried batch (the same key, as Trigger.dev's SDK sends it in the
``idempotency-key`` header of a one-request batch or the body of a two-phase one) answers with the
batch it made and its runs; the key expires (30 days unless told) and is freed by
``POST /api/v1/idempotencyKeys/{key}/reset``."""

from __future__ import annotations

import httpx
import orjson

from .conftest import Harness

DAY_S = 86400


def items(n: int) -> dict[str, object]:
    return {"items": [{"task": "hello", "payload": {"n": i}} for i in range(n)]}


async def batch_runs(api: httpx.AsyncClient, batch_id: str) -> list[str]:
    got = await api.get(f"/api/v2/batches/{batch_id}")
    assert got.status_code == 200, got.text
    runs: list[str] = got.json()["runs"]
    return runs


async def all_runs(h: Harness) -> int:
    return len(await h.engine.list_runs(h.env.env_id, tasks=["hello"], limit=100, light=True))


async def test_a_retried_v2_batch_answers_with_the_same_batch_and_runs(h: Harness, api: httpx.AsyncClient) -> None:
    headers = {"idempotency-key": "batch-key-1"}
    first = await api.post("/api/v2/tasks/batch", json=items(3), headers=headers)
    assert first.status_code == 200, first.text
    assert first.json()["isCached"] is False and first.json()["idempotencyKey"] == "batch-key-1"
    runs = await batch_runs(api, first.json()["id"])
    retried = await api.post("/api/v2/tasks/batch", json=items(3), headers=headers)  # an answer lost, sent again
    assert retried.status_code == 200, retried.text
    assert retried.json()["id"] == first.json()["id"] and retried.json()["isCached"] is True
    assert retried.json()["runCount"] == 3
    assert sorted(await batch_runs(api, first.json()["id"])) == sorted(runs) and len(runs) == 3
    assert await all_runs(h) == 3
    # another size under the same key is another request, refused; another key is another batch
    other_size = await api.post("/api/v2/tasks/batch", json=items(2), headers=headers)
    assert other_size.status_code == 409, other_size.text
    other = await api.post("/api/v2/tasks/batch", json=items(3), headers={"idempotency-key": "batch-key-2"})
    assert other.json()["id"] != first.json()["id"] and await all_runs(h) == 6


async def test_a_retried_v1_batch_answers_with_the_same_runs(h: Harness, api: httpx.AsyncClient) -> None:
    body = {"items": [{"task": "hello", "payload": 1}, {"task": "hello", "payload": 2,
                                                         "options": {"idempotencyKey": "own"}}]}
    first = await api.post("/api/v1/tasks/batch", json=body, headers={"idempotency-key": "k"})
    again = await api.post("/api/v1/tasks/batch", json=body, headers={"idempotency-key": "k"})
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert again.json()["id"] == first.json()["id"]
    assert [r["id"] for r in again.json()["runs"]] == [r["id"] for r in first.json()["runs"]]
    assert all(r["isCached"] for r in again.json()["runs"]) and await all_runs(h) == 2


async def test_a_retry_after_the_batch_was_made_without_its_runs_makes_them(h: Harness,
                                                                            api: httpx.AsyncClient) -> None:
    # the first attempt died between the batch's row and its runs
    batch_id, _, _ = await h.engine.open_batch(h.env.env_id, 2, "half-made", two_phase=False)
    retried = await api.post("/api/v2/tasks/batch", json=items(2), headers={"idempotency-key": "half-made"})
    assert retried.status_code == 200 and retried.json()["id"] == batch_id
    assert len(await batch_runs(api, batch_id)) == 2 and await all_runs(h) == 2


async def test_a_batch_without_a_key_is_made_again(h: Harness, api: httpx.AsyncClient) -> None:
    first = await api.post("/api/v2/tasks/batch", json=items(1))
    again = await api.post("/api/v2/tasks/batch", json=items(1))
    assert first.json()["id"] != again.json()["id"] and await all_runs(h) == 2
    assert "idempotencyKey" not in first.json()


async def test_bad_key_headers_are_refused(api: httpx.AsyncClient) -> None:
    for headers in ({"idempotency-key": "k" * 257}, {"idempotency-key": "k", "idempotency-key-ttl": "soon"},
                    {"idempotency-key": "k", "idempotency-key-ttl": "-5"}):
        answer = await api.post("/api/v2/tasks/batch", json=items(1), headers=headers)
        assert answer.status_code == 400, (headers, answer.text)


async def open_and_send(api: httpx.AsyncClient, key: str, payload: int, ttl: str | None = None) -> dict[str, object]:
    opened = await api.post("/api/v3/batches", json={"runCount": 1, "idempotencyKey": key}
                            | ({"idempotencyKeyTTL": ttl} if ttl else {}))
    assert opened.status_code == 200, opened.text
    sent = await api.post(f"/api/v3/batches/{opened.json()['id']}/items",
                          content=orjson.dumps({"index": 0, "task": "hello", "payload": payload}))
    assert sent.status_code == 200, sent.text
    answer: dict[str, object] = opened.json() | {"itemsAccepted": sent.json()["itemsAccepted"]}
    return answer


async def test_a_two_phase_batch_key_expires_after_its_ttl(h: Harness, api: httpx.AsyncClient) -> None:
    first = await open_and_send(api, "nightly", 1)
    h.clock.advance(29 * DAY_S)
    held = await open_and_send(api, "nightly", 2)
    assert held["id"] == first["id"] and held["isCached"] is True and held["itemsAccepted"] == 0
    h.clock.advance(2 * DAY_S)  # past the default 30 days
    later = await open_and_send(api, "nightly", 3)
    assert later["id"] != first["id"] and later["isCached"] is False and later["itemsAccepted"] == 1
    assert await all_runs(h) == 2
    # a TTL of its own
    short = await open_and_send(api, "hourly", 4, ttl="1h")
    h.clock.advance(3601)
    assert (await open_and_send(api, "hourly", 5))["id"] != short["id"]
    bad = await api.post("/api/v3/batches", json={"runCount": 1, "idempotencyKey": "x", "idempotencyKeyTTL": "soon"})
    assert bad.status_code == 400


async def test_a_one_request_batch_key_expires_after_its_ttl(h: Harness, api: httpx.AsyncClient) -> None:
    headers = {"idempotency-key": "k", "idempotency-key-ttl": "10m"}
    first = await api.post("/api/v2/tasks/batch", json=items(1), headers=headers)
    h.clock.advance(601)
    again = await api.post("/api/v2/tasks/batch", json=items(1), headers=headers)
    assert again.json()["id"] != first.json()["id"] and again.json()["isCached"] is False
    assert await all_runs(h) == 2


async def test_a_reset_frees_a_batch_key_at_once(h: Harness, api: httpx.AsyncClient) -> None:
    first = await open_and_send(api, "nightly", 1)
    reset = await api.post("/api/v1/idempotencyKeys/nightly/reset", json={"taskIdentifier": "hello"})
    assert reset.status_code == 200, reset.text
    second = await open_and_send(api, "nightly", 2)
    assert second["id"] != first["id"] and second["isCached"] is False and await all_runs(h) == 2
    v2 = await api.post("/api/v2/tasks/batch", json=items(1), headers={"idempotency-key": "once"})
    assert (await api.post("/api/v1/idempotencyKeys/once/reset", json={"taskIdentifier": "hello"})).status_code == 200
    again = await api.post("/api/v2/tasks/batch", json=items(1), headers={"idempotency-key": "once"})
    assert again.json()["id"] != v2.json()["id"]
