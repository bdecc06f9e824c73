"""The SDK's calls against the API over a real engine, through a connection a test can break:
answers that are not run-engine's (a proxy's page, a body cut short, the wrong shape) are a
TaskError, not a JSONDecodeError, KeyError or AttributeError."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from run_engine.sdk import Task, TaskError, runs

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


def refused(status: int, retry_after: str | None = None, body: bytes | None = None,
            content_type: str = "application/json") -> Fault:
    def fault(request: httpx.Request, through: Callable[[], Any]) -> httpx.Response:
        headers = {"content-type": content_type} | ({"retry-after": retry_after} if retry_after else {})
        return httpx.Response(status, headers=headers, content=body if body is not None else
                              b'{"error": {"code": "service_unavailable", "message": "redis away"}}')
    return fault


@pytest.fixture
async def wire(h: Harness, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Breakable]:
    """The SDK's every call goes to the harness's API through a :class:`Breakable` transport."""
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
    yield transport


def noop(payload: Any) -> None:
    return None


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
    wire.faults = [answer]
    with pytest.raises(TaskError) as bad:
        await Task(id="hello", fn=noop).trigger()
    assert h.env.api_key not in str(bad.value) and h.env.api_key not in repr(bad.value)
    wire.faults = [answer]
    with pytest.raises(TaskError):
        await Task(id="hello", fn=noop).batch_trigger([1])
    wire.faults = [answer]
    with pytest.raises(TaskError):
        await runs.retrieve("run_" + "a" * 24)
