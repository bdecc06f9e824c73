"""From a review of idempotency keys and waitpoint tokens (tenants, crashes, expiry, bad input):
each test shows a bug of the code before it."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from .conftest import Harness


async def batch_runs(api: httpx.AsyncClient, batch_id: str) -> list[str]:
    got = await api.get(f"/api/v2/batches/{batch_id}")
    assert got.status_code == 200, got.text
    runs: list[str] = got.json()["runs"]
    return runs


async def test_a_retried_stream_makes_no_second_run_of_an_item_whose_own_key_expired(
        h: Harness, api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A two-phase batch's stream retried after its first attempt made the runs and died before
    noting its items (the SDK sends it again): each index is deduplicated by its key. An item with
    a key of its own whose TTL had passed by then had that key released by the retry itself, and a
    second run of the item was made in the batch (a batch of 2 with 3 runs; the item ran twice)."""
    opened = await api.post("/api/v3/batches", json={"runCount": 2})
    batch_id = opened.json()["id"]
    lines = b"\n".join(orjson.dumps(item) for item in [
        {"index": 0, "task": "hello", "options": {"idempotencyKey": "own", "idempotencyKeyTTL": "1s"}},
        {"index": 1, "task": "hello"}])
    noted = h.engine.note_batch_items
    calls = 0

    async def dies_the_first_time(*args: Any, **kwargs: Any) -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("the process died before noting the items")
        return await noted(*args, **kwargs)

    monkeypatch.setattr(h.engine, "note_batch_items", dies_the_first_time)
    with pytest.raises(ConnectionError):
        await api.post(f"/api/v3/batches/{batch_id}/items", content=lines)
    made = await batch_runs(api, batch_id)
    assert len(made) == 2
    h.clock.advance(2)  # the item's own key has expired when the stream is sent again
    again = await api.post(f"/api/v3/batches/{batch_id}/items", content=lines)
    assert again.status_code == 200, again.text
    assert again.json()["sealed"] and again.json()["itemsDeduplicated"] == 2, again.json()
    assert sorted(await batch_runs(api, batch_id)) == sorted(made)  # before: a third run, item 0's again
    # outside the batch the key's TTL holds as ever: a trigger with it makes a new run
    other = await api.post("/api/v1/tasks/hello/trigger", json={"options": {"idempotencyKey": "own"}})
    assert other.status_code == 200 and other.json()["isCached"] is False and other.json()["id"] not in made


@pytest.mark.parametrize(("path", "body"), [
    ("/api/v1/tasks/hello/trigger", {"options": {"idempotencyKey": ""}}),
    ("/api/v2/tasks/batch", {"items": [{"task": "hello", "options": {"idempotencyKey": ""}}]}),
])
async def test_an_empty_idempotency_key_is_refused(h: Harness, api: httpx.AsyncClient, path: str,
                                                   body: dict[str, Any]) -> None:
    """``idempotencyKey: ""`` was a key like any other: every trigger with it answered with the
    first run for 30 days, and ``POST /api/v1/idempotencyKeys/{key}/reset``, which takes 1 to 256
    characters, could not free it. A token's empty key was refused (400) already."""
    first = await api.post(path, json=body)
    assert first.status_code == 400, first.text
    assert first.json()["error"]["code"] == "invalid_input" and "idempotencyKey" in first.json()["error"]["message"]
    assert await h.engine.list_runs(h.env.env_id, limit=10, light=True) == []


@pytest.mark.parametrize("options", [{"idempotencyKey": "k", "idempotencyKeyTTL": True}, {"ttl": True},
                                     {"delay": False}])
async def test_true_or_false_is_no_duration_of_a_trigger(h: Harness, api: httpx.AsyncClient,
                                                         options: dict[str, Any]) -> None:
    """pydantic took ``true`` for a number: ``idempotencyKeyTTL: true`` kept the key one second
    (a retry a second later made a second run), ``ttl: true`` was one second; a token's timeout and
    key TTL refused booleans already."""
    refused = await api.post("/api/v1/tasks/hello/trigger", json={"options": options})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "invalid_input"
    opened = await api.post("/api/v3/batches", json={"runCount": 1, "idempotencyKey": "b", "idempotencyKeyTTL": True})
    assert opened.status_code == 400, opened.text


async def test_the_engine_refuses_an_empty_idempotency_key(h: Harness) -> None:
    """The same at the engine (the SDK's and the engine's own callers): no run is made with it."""
    from run_engine.engine import TriggerRequest
    from run_engine.errors import ValidationError

    with pytest.raises(ValidationError, match="idempotency_key"):
        await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", idempotency_key=""))
    assert await h.engine.list_runs(h.env.env_id, limit=10, light=True) == []


class _HookedPool:
    """A pool whose connections run ``hook`` once, right after the first statement naming ``marker``:
    another request's write between two statements of one call, at that exact point."""

    def __init__(self, pool: Any, marker: str, hook: Any) -> None:
        self.pool, self.marker, self.hook, self.fired = pool, marker, hook, False

    def connection(self) -> Any:
        import contextlib

        hooked = self

        class Conn:
            def __init__(self, conn: Any) -> None:
                self.conn = conn

            def __getattr__(self, name: str) -> Any:
                return getattr(self.conn, name)

            async def execute(self, sql: str, *args: Any, **kwargs: Any) -> Any:
                cur = await self.conn.execute(sql, *args, **kwargs)
                if hooked.marker in sql and not hooked.fired:
                    hooked.fired = True
                    await hooked.hook()
                return cur

        @contextlib.asynccontextmanager
        async def connect() -> Any:
            async with self.pool.connection() as conn:
                yield Conn(conn)

        return connect()


async def test_a_batch_key_let_go_between_the_insert_and_the_look_up_opens_a_batch_not_a_500(
        h: Harness, api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests with one batch key at once: the first, refused for a bad item, frees the key it
    took (``release_empty_batch_key``) just after the second's insert found it taken and before the
    second read the batch holding it. The second asserted that the batch was there: an
    AssertionError, a 500 for a request that was fine (its retry would have worked)."""
    repo = h.engine.resources.repo.waitpoints
    first, _, _ = await h.engine.open_batch(h.env.env_id, 1, "shared", two_phase=False)  # the first request's row

    async def first_request_fails() -> None:  # its item refused: its key freed (it made no run)
        assert await h.engine.release_empty_batch_key(h.env.env_id, first)

    monkeypatch.setattr(repo, "pool", _HookedPool(repo.pool, "INSERT INTO batch_task_run", first_request_fails))
    second = await api.post("/api/v2/tasks/batch", json={"items": [{"task": "hello"}]},
                            headers={"idempotency-key": "shared"})
    assert second.status_code == 200, second.text  # before: 500
    assert second.json()["id"] != first and second.json()["isCached"] is False
    assert len(await batch_runs(api, second.json()["id"])) == 1
