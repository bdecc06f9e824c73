"""What a caller holding less than the environment's secret key (a public access token, a run's
token) may reach through options another party's requests share with it: a batch's idempotency
key (the environment's, not a task's) and a trigger's queue. It never reads another party's batch
through the token the answer carries, never adds runs to another party's batch, and never changes
a queue's concurrency limit; the batch it made itself, its retry makes whole."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from run_engine.api.public_tokens import AUDIENCE, ISSUER, sign
from run_engine.engine import TriggerRequest
from run_engine.run_tokens import RunTokens

from .conftest import Harness, api_client

BATCH_ROUTES = ("/api/v1/tasks/batch", "/api/v2/tasks/batch")


def public_token(h: Harness, scopes: list[str], **claims: Any) -> str:
    now = int(h.clock.now())
    return sign(h.env.api_key, {"sub": h.env.env_id, "pub": True, "iss": ISSUER, "aud": AUDIENCE, "iat": now,
                                "exp": now + 600, "scopes": scopes, **claims})


async def run_token(h: Harness) -> str:
    """The token of a started run of ``hello`` (its attempt 1)."""
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    handed = await h.engine.dequeue(h.env.worker_group_id, 10, start=True)
    assert run.id in [d.run.id for d in handed]
    return RunTokens("test-secret").mint(run.id, 1, int(h.clock.now()) + 3600)


async def batch_runs(h: Harness, batch_id: str) -> list[tuple[str, Any]]:
    """(task, payload) of the batch's runs."""
    runs = await h.engine.list_runs(h.env.env_id, batches=[batch_id], limit=100)
    return [(r.task_id, r.payload) for r in runs]


async def backend_batch(h: Harness, route: str, key: str, task: str = "limited") -> tuple[str, str]:
    """A batch of one item made with the secret key: its id and its run's."""
    async with api_client(h) as api:
        made = await api.post(route, headers={"idempotency-key": key},
                              json={"items": [{"task": task, "payload": {"card": "4111-1111"}}]})
        assert made.status_code == 200, made.text
        batch_id = made.json()["id"]
    (run,) = await h.engine.list_runs(h.env.env_id, batches=[batch_id], limit=10)
    return batch_id, run.id


async def can_read(h: Harness, token: str, batch_id: str, run_id: str) -> list[str]:
    """The reads of the batch and its run that ``token`` is let through."""
    async with api_client(h, token) as api:
        answers = {"v1 batch": await api.get(f"/api/v1/batches/{batch_id}"),
                   "v2 batch": await api.get(f"/api/v2/batches/{batch_id}"),
                   "run": await api.get(f"/api/v3/runs/{run_id}")}
    return [what for what, got in answers.items() if got.status_code == 200]


# --- a batch's idempotency key -------------------------------------------------------------------

@pytest.mark.parametrize("route", BATCH_ROUTES)
@pytest.mark.parametrize("task", ["limited", "hello"])
async def test_a_batch_key_gives_a_trigger_only_token_no_read_token_for_the_batch_it_finds(
        h: Harness, route: str, task: str) -> None:
    """A public token that may only batch-trigger ``hello`` names the key of a batch the backend
    made (of another task, or of ``hello`` itself, which its items then match): it is never handed
    a token that reads that batch or its runs (as a single trigger's run found by its key)."""
    victim_batch, victim_run = await backend_batch(h, route, "order-42", task)
    async with api_client(h, public_token(h, ["batchTrigger:tasks:hello"])) as api:
        got = await api.post(route, headers={"idempotency-key": "order-42"},
                             json={"items": [{"task": "hello", "payload": {}}]})
    assert got.status_code == (409 if task == "limited" else 200), got.text
    assert "x-trigger-jwt" not in got.headers and "x-trigger-jwt-claims" not in got.headers
    if task == "hello":  # the request matches the batch: its ids, as a cached single trigger's
        assert got.json()["id"] == victim_batch
        assert got.json().get("isCached", True) is True
    assert await batch_runs(h, victim_batch) == [(task, {"card": "4111-1111"})]


async def test_a_batch_key_gives_a_run_token_no_read_token_for_the_batch_it_finds(h: Harness) -> None:
    victim_batch, victim_run = await backend_batch(h, BATCH_ROUTES[0], "nightly", "hello")
    token = await run_token(h)
    assert await can_read(h, token, victim_batch, victim_run) == []  # as API.md says
    async with api_client(h, token) as api:
        got = await api.post(BATCH_ROUTES[0], headers={"idempotency-key": "nightly"},
                             json={"items": [{"task": "hello", "payload": {}}]})
    assert got.status_code == 200, got.text
    assert got.json()["runs"] == [{"id": victim_run, "taskIdentifier": "hello", "isCached": True}]
    assert "x-trigger-jwt" not in got.headers


async def test_a_scoped_caller_still_gets_a_read_token_for_the_batch_it_makes(h: Harness) -> None:
    token = public_token(h, ["batchTrigger:tasks:hello"])
    for route in BATCH_ROUTES:
        async with api_client(h, token) as api:
            got = await api.post(route, headers={"idempotency-key": f"mine-{route}"},
                                 json={"items": [{"task": "hello", "payload": {}}]})
        assert got.status_code == 200, got.text
        (run,) = await h.engine.list_runs(h.env.env_id, batches=[got.json()["id"]], limit=10)
        assert await can_read(h, got.headers["x-trigger-jwt"], got.json()["id"], run.id) == [
            "v1 batch", "v2 batch", "run"]


@pytest.mark.parametrize("route", BATCH_ROUTES)
async def test_a_batch_found_by_its_key_gets_no_new_runs(h: Harness, route: str) -> None:
    """Each item of a keyed batch is keyed ``{batch}:{index}``, a key per task: an item of another
    task (or with a fresh key of its own) misses it and made a new run inside the batch found."""
    victim_batch, _ = await backend_batch(h, route, "order-44")
    injected = [{"items": [{"task": "hello", "payload": {"injected": True}}]},
                {"items": [{"task": "limited", "payload": {"injected": True}, "options": {"idempotencyKey": "new"}}]}]
    async with api_client(h, public_token(h, ["batchTrigger:tasks:hello", "batchTrigger:tasks:limited"])) as api:
        for body in injected:
            again = await api.post(route, headers={"idempotency-key": "order-44"}, json=body)
            assert again.status_code == 409, again.text
            assert "x-trigger-jwt" not in again.headers
    # the secret key's other request is answered with the batch as it is
    async with api_client(h) as api:
        for body in injected:
            again = await api.post(route, headers={"idempotency-key": "order-44"}, json=body)
            assert again.status_code == 200 and again.json()["id"] == victim_batch, again.text
            if route == BATCH_ROUTES[0]:
                assert [(r["taskIdentifier"], r["isCached"]) for r in again.json()["runs"]] == [("limited", True)]
            else:
                assert again.json()["isCached"] is True
    assert await batch_runs(h, victim_batch) == [("limited", {"card": "4111-1111"})]


class Died(BaseException):
    """The server process dying (no handler runs: not an Exception)."""


async def die_before_the_runs(h: Harness, monkeypatch: pytest.MonkeyPatch, token: str, route: str, key: str,
                              body: dict[str, Any]) -> str:
    """A keyed batch request whose process dies between its batch's row and its runs' insert: the
    batch's id (it has no run)."""
    async def died(requests: Any) -> Any:
        raise Died

    monkeypatch.setattr(h.engine, "trigger_each", died)  # the call a one-request batch makes its runs with
    async with api_client(h, token) as api:
        with pytest.raises(Died):
            await api.post(route, headers={"idempotency-key": key}, json=body)
    monkeypatch.undo()
    batch_id, _, found = await h.engine.open_batch(h.env.env_id, len(body["items"]), key, two_phase=False)
    assert found and await batch_runs(h, batch_id) == []
    return batch_id


@pytest.mark.parametrize("route", BATCH_ROUTES)
@pytest.mark.parametrize("caller", ["public", "run"])
async def test_a_scoped_callers_retry_makes_the_runs_its_dead_first_attempt_did_not(
        h: Harness, monkeypatch: pytest.MonkeyPatch, route: str, caller: str) -> None:
    """The batch is its maker's own (``batch_task_run.made_by``): the same token's retry makes its
    runs as the secret key's would, and may read the batch (it made none and was answered 200 with
    none: no run until the key expired, 30 days)."""
    token = public_token(h, ["batchTrigger:tasks:hello"]) if caller == "public" else await run_token(h)
    body: dict[str, Any] = {"items": [{"task": "hello", "payload": {"n": 1}}]}
    batch_id = await die_before_the_runs(h, monkeypatch, token, route, "frontend-order-7", body)
    async with api_client(h, token) as api:
        retry = await api.post(route, headers={"idempotency-key": "frontend-order-7"}, json=body)
        assert retry.status_code == 200 and retry.json()["id"] == batch_id, retry.text
        again = await api.post(route, headers={"idempotency-key": "frontend-order-7"}, json=body)
    assert await batch_runs(h, batch_id) == [("hello", {"n": 1})]
    (run,) = await h.engine.list_runs(h.env.env_id, batches=[batch_id], limit=10)
    if route == BATCH_ROUTES[0]:
        assert retry.json()["runs"] == [{"id": run.id, "taskIdentifier": "hello", "isCached": False}]
        assert again.json()["runs"] == [{"id": run.id, "taskIdentifier": "hello", "isCached": True}]
    else:
        assert retry.json()["isCached"] is True and retry.json()["runCount"] == 1
    assert await can_read(h, retry.headers["x-trigger-jwt"], batch_id, run.id) == ["v1 batch", "v2 batch", "run"]


async def test_only_its_maker_and_the_secret_key_make_the_runs_of_a_batch_made_without_them(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch whose first request died between its row and its runs: another caller holding a
    token (of the same scopes, or a run's), whose scopes cannot be shown to cover the tasks it was
    made of, makes none of them (nor puts its own in it), learns nothing of it and is told so
    (409; it was answered 200 with the runs there were: a batch answered as made whose items never
    ran); nor
    does any token make those of a batch whose row does not say who made it (made before
    ``made_by`` was kept, or by a process of the version before: a rolling upgrade). The maker's
    retry, or the secret key's, makes them."""
    body: dict[str, Any] = {"items": [{"task": "hello", "payload": {"n": 1}}]}
    maker = public_token(h, ["batchTrigger:tasks:hello"])
    made_by_token = await die_before_the_runs(h, monkeypatch, maker, BATCH_ROUTES[0], "half-made", body)
    unknown, _, _ = await h.engine.open_batch(h.env.env_id, 1, "old-row", two_phase=False)  # made_by NULL
    injected = {"items": [{"task": "hello", "payload": {"injected": True}}]}
    tried = [(token, key) for token in (public_token(h, ["batchTrigger:tasks:hello"], n=2), await run_token(h))
             for key in ("half-made", "old-row")] + [(maker, "old-row")]
    for token, key in tried:
        async with api_client(h, token) as api:
            for route in BATCH_ROUTES:
                got = await api.post(route, headers={"idempotency-key": key}, json=injected)
                assert got.status_code == 409 and got.json()["error"]["code"] == "conflict", got.text
                assert "x-trigger-jwt" not in got.headers and "batch_" not in got.text
    assert await batch_runs(h, made_by_token) == [] and await batch_runs(h, unknown) == []
    async with api_client(h, maker) as api:
        retry = await api.post(BATCH_ROUTES[0], headers={"idempotency-key": "half-made"}, json=body)
    assert retry.status_code == 200 and retry.json()["runs"][0]["isCached"] is False, retry.text
    assert await batch_runs(h, made_by_token) == [("hello", {"n": 1})]
    async with api_client(h) as api:
        made = await api.post(BATCH_ROUTES[0], headers={"idempotency-key": "old-row"},
                              json={"items": [{"task": "limited", "payload": {"n": 1}}]})
    assert made.status_code == 200 and made.json()["runs"][0]["isCached"] is False, made.text
    assert await batch_runs(h, unknown) == [("limited", {"n": 1})]


async def test_a_scoped_callers_retry_answers_every_item_in_its_place(h: Harness) -> None:
    """An item that joined a run outside the batch by its own ``idempotencyKey`` is answered at its
    index with that run (v1 matches runs to items by position: the retry answered the batch's one
    run, item 1's, at index 0), for the token that made the batch, another token sending the same
    items, and the secret key; nothing is made again."""
    outside = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", idempotency_key="pre"))
    token = public_token(h, ["batchTrigger:tasks:hello"])
    body = {"items": [{"task": "hello", "payload": {"i": 0}, "options": {"idempotencyKey": "pre"}},
                      {"task": "hello", "payload": {"i": 1}}]}
    async with api_client(h, token) as api:
        first = await api.post(BATCH_ROUTES[0], headers={"idempotency-key": "b-1"}, json=body)
        assert first.status_code == 200, first.text
        again = await api.post(BATCH_ROUTES[0], headers={"idempotency-key": "b-1"}, json=body)
    first_ids = [r["id"] for r in first.json()["runs"]]
    assert first_ids[0] == outside.id
    retried = {"maker": again}
    for name, credential in (("another token", public_token(h, ["batchTrigger:tasks:hello"], n=2)),
                             ("secret key", None)):
        async with api_client(h, credential) as api:
            retried[name] = await api.post(BATCH_ROUTES[0], headers={"idempotency-key": "b-1"}, json=body)
    for name, got in retried.items():
        assert got.status_code == 200, (name, got.text)
        assert [r["id"] for r in got.json()["runs"]] == first_ids, f"{name}: first {first_ids}, retried {got.json()}"
        assert all(r["isCached"] for r in got.json()["runs"]), (name, got.text)
    assert "x-trigger-jwt" in again.headers and "x-trigger-jwt" not in retried["another token"].headers
    assert await batch_runs(h, first.json()["id"]) == [("hello", {"i": 1})]


async def test_a_batch_request_refused_before_its_runs_frees_its_key(h: Harness) -> None:
    """A keyed batch refused for an item (after its row was made) leaves no key behind: the
    corrected retry makes the batch, whatever credential sends it (a batch found by its key is
    made whole for the secret key only)."""
    token = public_token(h, ["batchTrigger:tasks:hello"])
    async with api_client(h, token) as api:
        bad = await api.post(BATCH_ROUTES[1], headers={"idempotency-key": "k"},
                             json={"items": [{"task": "hello", "payload": {}, "options": {"workerGroup": "nope"}}]})
        assert bad.status_code == 400, bad.text
        good = await api.post(BATCH_ROUTES[1], headers={"idempotency-key": "k"},
                              json={"items": [{"task": "hello", "payload": {"n": 1}}]})
        assert good.status_code == 200 and good.json()["isCached"] is False, good.text
        again = await api.post(BATCH_ROUTES[1], headers={"idempotency-key": "k"},
                               json={"items": [{"task": "hello", "payload": {"n": 1}}]})
    assert again.json()["id"] == good.json()["id"] and again.json()["isCached"] is True
    assert await batch_runs(h, good.json()["id"]) == [("hello", {"n": 1})]


async def test_a_scoped_caller_learns_no_size_of_another_batch(h: Harness) -> None:
    await backend_batch(h, BATCH_ROUTES[1], "sized")
    async with api_client(h, public_token(h, ["batchTrigger:tasks:hello"])) as api:
        got = await api.post(BATCH_ROUTES[1], headers={"idempotency-key": "sized"},
                             json={"items": [{"task": "hello", "payload": {}}] * 2})
    assert got.status_code == 409 and "1" not in got.json()["error"]["message"], got.text


# --- a trigger's queue ---------------------------------------------------------------------------

async def queue_limit(api: httpx.AsyncClient, name: str) -> int | None:
    got = await api.get(f"/api/v1/queues/{name}")
    assert got.status_code == 200, got.text
    limit: int | None = got.json()["concurrencyLimit"]
    return limit


@pytest.mark.parametrize("caller", ["public", "run"])
async def test_a_scoped_trigger_cannot_set_a_queues_concurrency_limit(h: Harness, caller: str) -> None:
    """A token that may only trigger ``hello`` names the queue ``limited`` (another task's,
    deployed with limit 1) with ``concurrencyLimit: 0``: refused (it rewrote the limit for every
    run of the environment, 0 stalling the queue), as is a new queue's limit; the backend's runs
    of ``limited`` still start. Naming the queue alone is allowed."""
    token = public_token(h, ["trigger:tasks:hello", "batchTrigger:tasks:hello"]) if caller == "public" \
        else await run_token(h)
    limited = {"queue": {"name": "limited", "concurrencyLimit": 0}}
    async with api_client(h, token) as api:
        for path, body in (("/api/v1/tasks/hello/trigger", {"payload": {}, "options": limited}),
                           ("/api/v1/tasks/hello/trigger",
                            {"payload": {}, "options": {"queue": {"name": "fresh", "concurrencyLimit": 5}}}),
                           (BATCH_ROUTES[0], {"items": [{"task": "hello", "options": limited}]}),
                           (BATCH_ROUTES[1], {"items": [{"task": "hello"}, {"task": "hello", "options": limited}]})):
            got = await api.post(path, json=body)
            assert got.status_code == 403, got.text
            assert "options.queue.concurrencyLimit" in got.json()["error"]["message"]
        named = await api.post("/api/v1/tasks/hello/trigger",
                               json={"payload": {}, "options": {"queue": {"name": "fresh"}}})
        assert named.status_code == 200, named.text
    async with api_client(h) as api:
        assert await queue_limit(api, "limited") == 1
        assert await queue_limit(api, "fresh") is None
        victim = (await api.post("/api/v1/tasks/limited/trigger", json={"payload": {}})).json()["id"]
    assert await h.engine.list_runs(h.env.env_id, tasks=["hello"], queues=["limited"], limit=10) == []
    handed = [d.run.id for d in await h.engine.dequeue(h.env.worker_group_id, 10)]
    assert victim in handed and named.json()["id"] in handed


async def test_the_secret_key_still_sets_a_queues_concurrency_limit_by_trigger(h: Harness,
                                                                               api: httpx.AsyncClient) -> None:
    got = await api.post("/api/v1/tasks/hello/trigger",
                         json={"payload": {}, "options": {"queue": {"name": "reports", "concurrencyLimit": 2}}})
    assert got.status_code == 200, got.text
    assert await queue_limit(api, "reports") == 2
