"""From a review of idempotency keys and waitpoint tokens (tenants, crashes, expiry, bad input):
each test shows a bug of the code before it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from .conftest import Harness


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
