"""The SDK's calls against the API over a real engine, through a connection a test can break: an
answer lost after the server did the work, a server asking to wait (429/503 with Retry-After), and
answers that are not run-engine's (a proxy's page, a body cut short, the wrong shape)."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

import run_engine.sdk.client as client_module
from run_engine.sdk import Task, TaskError, runs, tokens

from .conftest import Harness

Fault = Callable[[httpx.Request, Callable[[], Any]], Any]


class Breakable(httpx.AsyncBaseTransport):
    """The API app in process; ``faults`` (by order of the requests) decide what each request gets:
    None sends it through."""

    def __init__(self, app: Any) -> None:
        self.inner = httpx.ASGITransport(app=app)
        self.faults: list[Fault | None] = []
        self.seen: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        fault = self.faults.pop(0) if self.faults else None
        if fault is None:
            return await self.inner.handle_async_request(request)

        async def through() -> httpx.Response:
            response = await self.inner.handle_async_request(request)
            await response.aread()
            return response

        result = fault(request, through)
        return await result if hasattr(result, "__await__") else result


async def lost_answer(request: httpx.Request, through: Callable[[], Any]) -> httpx.Response:
    """The server does the work and commits; the connection drops before the answer is read."""
    await through()
    raise httpx.ReadError("connection reset by peer", request=request)


def refused(status: int, retry_after: str | None = None, body: bytes | None = None,
            content_type: str = "application/json") -> Fault:
    def fault(request: httpx.Request, through: Callable[[], Any]) -> httpx.Response:
        headers = {"content-type": content_type} | ({"retry-after": retry_after} if retry_after else {})
        return httpx.Response(status, headers=headers, content=body if body is not None else
                              b'{"error": {"code": "service_unavailable", "message": "redis away"}}')
    return fault


def unreachable(request: httpx.Request, through: Callable[[], Any]) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


@pytest.fixture
async def wire(h: Harness, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Breakable]:
    """The SDK's every call goes to the harness's API through a :class:`Breakable` transport; its
    pauses are noted, not slept."""
    from run_engine.api.app import create_app
    from run_engine.api.context import ApiContext
    from run_engine.run_tokens import RunTokens
    from run_engine.wakeups import WakeUps

    ctx = ApiContext(engine=h.engine, tokens=RunTokens("test-secret"),
                     wakeups=WakeUps(h.engine.redis, channel=f"{h.engine.resources.settings.key_prefix}:wake"),
                     public_url="http://t", secret="test-secret")
    transport = Breakable(create_app(ctx))
    monkeypatch.setattr(httpx, "AsyncClient", functools.partial(httpx.AsyncClient, transport=transport))
    monkeypatch.setenv("RUN_ENGINE_API_URL", "http://t")
    monkeypatch.setenv("RUN_ENGINE_API_KEY", h.env.api_key)
    monkeypatch.delenv("RUN_ENGINE_RUN_TOKEN", raising=False)
    pauses: list[float] = []

    async def pause(seconds: float) -> None:
        pauses.append(seconds)

    monkeypatch.setattr(client_module, "_pause", pause, raising=False)
    transport.pauses = pauses  # type: ignore[attr-defined]
    yield transport


def noop(payload: Any) -> None:
    return None


async def tagged(h: Harness, tag: str) -> list[str]:
    return [r.id for r in await h.engine.list_runs(h.env.env_id, tags=[tag], limit=100)]


async def test_a_trigger_whose_answer_was_lost_is_tried_again_and_makes_one_run(h: Harness, wire: Breakable,
                                                                                 unique: str) -> None:
    wire.faults = [lost_answer]
    handle = await Task(id="hello", fn=noop).trigger({"n": 1}, {"tags": [f"t-{unique}"]})
    assert await tagged(h, f"t-{unique}") == [handle.id]
    assert handle.is_cached is False  # the run this call made, found by its own key
    keys = {json.loads(r.content)["options"]["idempotencyKey"] for r in wire.seen}
    assert len(wire.seen) == 2 and len(keys) == 1  # both tries carried the same key


async def test_a_calls_own_key_is_kept_for_its_tries_not_for_a_month(h: Harness, wire: Breakable,
                                                                      unique: str) -> None:
    """Retention keeps a run (and a token) for as long as its idempotency key holds: with the
    server's default TTL (30 days) for the SDK's own keys, every run the SDK triggered outside a task
    was kept a month whatever the installation's retention. Its own keys now hold for an hour (its
    tries); a key or a TTL of the caller's is kept as given."""
    from datetime import UTC, datetime, timedelta

    async def key_expiry(run_id: str) -> datetime:
        async with h.engine.resources.repo.pool.connection() as conn:
            cur = await conn.execute("SELECT idempotency_key_expires_at FROM task_run WHERE id = %s", (run_id,))
            return (await cur.fetchone())[0]  # type: ignore[index]

    hour = datetime.now(UTC) + timedelta(hours=1)
    own = await Task(id="hello", fn=noop).trigger(None, {"tags": [f"k-{unique}"]})
    assert abs((await key_expiry(own.id) - hour).total_seconds()) < 600
    batch = await Task(id="hello", fn=noop).batch_trigger([1], {"tags": [f"k-{unique}"]})
    async with h.engine.resources.repo.pool.connection() as conn:
        cur = await conn.execute("SELECT b.idempotency_key_expires_at FROM batch_task_run b JOIN task_run r"
                                 " ON r.batch_id = b.id WHERE r.id = %s", (batch[0].id,))
        assert abs(((await cur.fetchone())[0] - hour).total_seconds()) < 600  # type: ignore[index]
    assert abs((await key_expiry(batch[0].id) - hour).total_seconds()) < 600  # its item's key, <batch>:<index>
    token = await tokens.create()
    async with h.engine.resources.repo.pool.connection() as conn:
        cur = await conn.execute("SELECT idempotency_key_expires_at FROM waitpoint WHERE id = %s", (token.id,))
        assert abs(((await cur.fetchone())[0] - hour).total_seconds()) < 600  # type: ignore[index]
    theirs = await Task(id="hello", fn=noop).trigger(None, {"idempotencyKey": unique, "idempotencyKeyTTL": "2d"})
    assert abs((await key_expiry(theirs.id) - hour - timedelta(hours=47)).total_seconds()) < 600


async def test_a_trigger_with_the_callers_key_keeps_it(h: Harness, wire: Breakable, unique: str) -> None:
    wire.faults = [lost_answer]
    handle = await Task(id="hello", fn=noop).trigger(None, {"tags": [f"t-{unique}"], "idempotencyKey": unique})
    assert await tagged(h, f"t-{unique}") == [handle.id]
    assert (await runs.retrieve(handle.id))["idempotencyKey"] == unique


async def test_a_batch_whose_answer_was_lost_is_tried_again_and_makes_each_run_once(h: Harness, wire: Breakable,
                                                                                    unique: str) -> None:
    wire.faults = [lost_answer]
    handles = await Task(id="hello", fn=noop).batch_trigger([1, 2, 3], {"tags": [f"b-{unique}"]})
    assert sorted(h.id for h in handles) == sorted(await tagged(h, f"b-{unique}")) and len(handles) == 3
    assert [(await runs.retrieve(x.id))["payload"] for x in handles] == [1, 2, 3]
    assert not any(x.is_cached for x in handles)


async def test_a_replay_whose_answer_was_lost_is_not_made_again(h: Harness, wire: Breakable, unique: str) -> None:
    original = await Task(id="hello", fn=noop).trigger(None, {"tags": [f"r-{unique}"]})
    wire.faults = [lost_answer]
    with pytest.raises(TaskError) as lost:
        await runs.replay(original.id)
    assert lost.value.code == "outcome_unknown" and "may have done it" in str(lost.value)
    assert len(await tagged(h, f"r-{unique}")) == 2  # the run and the one replay the server made


async def test_cancel_and_token_completion_are_tried_again_after_a_lost_answer(h: Harness, wire: Breakable,
                                                                               unique: str) -> None:
    run = await Task(id="hello", fn=noop).trigger()
    wire.faults = [lost_answer]
    assert (await runs.cancel(run.id))["id"] == run.id
    assert (await runs.retrieve(run.id))["status"] == "CANCELED"
    token = await tokens.create()
    wire.faults = [lost_answer]
    await tokens.complete(token.id, {"ok": unique})
    done = await tokens.retrieve(token.id)
    assert done["status"] == "COMPLETED" and done["output"] == {"ok": unique}


async def test_a_token_create_whose_answer_was_lost_makes_one_token(h: Harness, wire: Breakable, unique: str) -> None:
    wire.faults = [lost_answer]
    token = await tokens.create(tags=[f"k-{unique}"])
    assert token.is_cached is False
    listed, _ = await h.engine.list_tokens(h.env.env_id, tags=[f"k-{unique}"], limit=10)
    assert [w.id for w in listed] == [token.id]
    sent = {json.loads(r.content)["idempotencyKey"] for r in wire.seen}
    assert len(wire.seen) == 2 and len(sent) == 1


async def test_retry_after_is_waited_for_and_the_tries_are_bounded(h: Harness, wire: Breakable) -> None:
    run = await Task(id="hello", fn=noop).trigger()
    wire.seen.clear()
    wire.faults = [refused(503, "2"), refused(429, "1")]
    assert (await runs.retrieve(run.id))["id"] == run.id
    assert wire.pauses == [2.0, 1.0]  # type: ignore[attr-defined]
    wire.seen.clear()
    wire.faults = [refused(503, "0")] * 10
    with pytest.raises(TaskError) as gave_up:
        await runs.retrieve(run.id)
    assert gave_up.value.status == 503 and gave_up.value.code == "service_unavailable"
    assert len(wire.seen) == client_module.TRIES


async def test_a_server_asking_for_a_long_pause_is_answered_at_once(h: Harness, wire: Breakable) -> None:
    run = await Task(id="hello", fn=noop).trigger()
    wire.seen.clear()
    wire.faults = [refused(429, "3600")]
    with pytest.raises(TaskError) as refused_:
        await runs.retrieve(run.id)
    assert refused_.value.status == 429 and len(wire.seen) == 1


async def test_a_replay_refused_by_503_is_not_sent_again_but_one_refused_by_429_is(h: Harness, wire: Breakable,
                                                                                   unique: str) -> None:
    original = await Task(id="hello", fn=noop).trigger(None, {"tags": [f"q-{unique}"]})
    wire.faults = [refused(503, "1")]
    with pytest.raises(TaskError) as unavailable:
        await runs.replay(original.id)
    assert unavailable.value.status == 503
    wire.faults = [refused(429, "1")]  # a rate limit refuses before anything is done
    await runs.replay(original.id)
    assert len(await tagged(h, f"q-{unique}")) == 2


async def test_a_server_that_cannot_be_reached_is_a_task_error_after_the_tries(h: Harness, wire: Breakable) -> None:
    wire.faults = [unreachable] * 10
    with pytest.raises(TaskError) as down:
        await Task(id="hello", fn=noop).trigger()
    assert down.value.status == 0 and down.value.code == "unreachable"
    assert len(wire.seen) == client_module.TRIES


@pytest.mark.parametrize("answer", [
    refused(200, body=b"<html><body>Welcome to nginx</body></html>", content_type="text/html"),
    refused(502, body=b"<html><body>502 Bad Gateway</body></html>", content_type="text/html"),
    refused(200, body=b'{"id": "run_abc', content_type="application/json"),
    refused(200, body=b'["run_abc"]'),
    refused(200, body=b'{"ok": true}'),
    refused(404, body=b'"not found"'),
    refused(400, body=b'{"error": "bad"}'),
])
async def test_an_answer_that_is_not_run_engines_is_a_task_error(h: Harness, wire: Breakable, answer: Fault) -> None:
    wire.faults = [answer] * client_module.TRIES
    with pytest.raises(TaskError) as bad:
        await Task(id="hello", fn=noop).trigger()
    assert h.env.api_key not in str(bad.value) and h.env.api_key not in repr(bad.value)
    wire.faults = [answer] * client_module.TRIES
    with pytest.raises(TaskError):
        await Task(id="hello", fn=noop).batch_trigger([1])
    wire.faults = [answer] * client_module.TRIES
    with pytest.raises(TaskError):
        await runs.retrieve("run_" + "a" * 24)
