"""`POST /api/v1/idempotencyKeys/{key}/reset` (Trigger.dev's SDK's `idempotencyKeys.reset`): the
key is freed before its TTL for that task in that environment only, and the next trigger makes a
new run."""

from __future__ import annotations

import httpx

from run_engine.tenancy import ensure_environment

from .conftest import Harness


async def trigger(api: httpx.AsyncClient, task: str, key: str, headers: dict[str, str] | None = None) -> str:
    made = await api.post(f"/api/v1/tasks/{task}/trigger", json={"payload": 1, "options": {"idempotencyKey": key}},
                          headers=headers)
    assert made.status_code == 200, made.text
    run_id: str = made.json()["id"]
    return run_id


async def test_a_reset_key_makes_a_new_run_and_only_for_its_task_and_environment(
        h: Harness, api: httpx.AsyncClient) -> None:
    key = "order/42 é"  # any characters, as the SDK sends them (URL-encoded)
    first = await trigger(api, "hello", key)
    assert await trigger(api, "hello", key) == first
    other_task = await trigger(api, "other", key)
    other = await ensure_environment(h.engine.resources.repo, secret="test-secret", org="other-org", project="p",
                                     env="dev")
    theirs_headers = {"Authorization": f"Bearer {other.api_key}"}
    theirs = await trigger(api, "hello", key, theirs_headers)

    path = "/api/v1/idempotencyKeys/order%2F42%20%C3%A9/reset"
    freed = await api.post(path, json={"taskIdentifier": "hello"}, headers=theirs_headers)
    assert freed.status_code == 200 and freed.json() == {"id": key}  # their own run's key: theirs to free
    assert await trigger(api, "hello", key) == first  # ours still held
    reset = await api.post(path, json={"taskIdentifier": "hello"})
    assert reset.status_code == 200 and reset.json() == {"id": key}
    second = await trigger(api, "hello", key)
    assert second != first and await trigger(api, "hello", key) == second
    assert await trigger(api, "other", key) == other_task  # another task's key is its own
    assert (await h.engine.get_run(first, h.env.env_id)) is not None  # the run itself is untouched
    assert await trigger(api, "hello", key, theirs_headers) != theirs


async def test_a_key_no_run_holds_or_a_bad_request_is_refused(h: Harness, api: httpx.AsyncClient) -> None:
    missing = await api.post("/api/v1/idempotencyKeys/nobody/reset", json={"taskIdentifier": "hello"})
    assert missing.status_code == 404 and "idempotency key" in missing.json()["error"]["message"]
    for bad in ({}, {"taskIdentifier": ""}, {"taskIdentifier": 7}, {"taskIdentifier": "t" * 129}):
        answer = await api.post("/api/v1/idempotencyKeys/k/reset", json=bad)
        assert answer.status_code == 400, (bad, answer.text)
    too_long = await api.post(f"/api/v1/idempotencyKeys/{'k' * 257}/reset", json={"taskIdentifier": "hello"})
    assert too_long.status_code == 400
    unauthenticated = await api.post("/api/v1/idempotencyKeys/k/reset", json={"taskIdentifier": "hello"},
                                     headers={"Authorization": ""})
    assert unauthenticated.status_code == 401
