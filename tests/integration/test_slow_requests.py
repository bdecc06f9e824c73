"""A request that stops arriving is closed by the server (run_engine/api/slow_requests.py, on its
own protocol over a real uvicorn socket). Before, a connection that sent nothing, a request head
sent a byte at a time or a body that stopped half way stayed open for as long as its client kept
it: thousands of them, opened before any credential is asked for, took every descriptor of the
server process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import uvicorn

from run_engine.api import slow_requests
from run_engine.api.app import create_app
from run_engine.api.context import ApiContext
from run_engine.run_tokens import RunTokens
from run_engine.server import _http_protocol
from run_engine.wakeups import WakeUps

from .conftest import Harness
from .test_unread_answers import _port


@pytest.fixture
async def port(h: Harness, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[int]:
    for name, value in (("head_s", 1.0), ("body_idle_s", 2.0), ("body_s", 30.0), ("check_s", 0.1)):
        monkeypatch.setattr(slow_requests.SLOW, name, value)
    ctx = ApiContext(engine=h.engine, tokens=RunTokens("test-secret"),
                     wakeups=WakeUps(h.engine.redis, channel=f"{h.engine.resources.settings.key_prefix}:wake"),
                     public_url="http://t", secret="test-secret")
    at = _port()
    server = uvicorn.Server(uvicorn.Config(create_app(ctx), host="127.0.0.1", port=at, log_level="warning",
                                           access_log=False, log_config=None, lifespan="off",
                                           timeout_graceful_shutdown=1, http=_http_protocol()))
    serving = asyncio.ensure_future(server.serve())
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and not serving.done()
        await asyncio.sleep(0.02)
    try:
        yield at
    finally:
        server.should_exit = True
        await serving


async def until_closed(reader: asyncio.StreamReader) -> bytes:
    """What the server sends until it closes the connection (30 s at most)."""
    got = b""
    deadline = time.monotonic() + 30
    while chunk := await asyncio.wait_for(reader.read(65536), max(0.1, deadline - time.monotonic())):
        got += chunk
    return got


async def test_a_connection_that_sends_nothing_or_half_a_head_is_answered_408_and_closed(port: int) -> None:
    silent = await asyncio.open_connection("127.0.0.1", port)
    half = await asyncio.open_connection("127.0.0.1", port)
    half[1].write(b"GET /healthz HTTP/1.1\r\nhost: t\r\n")  # and never the blank line
    await half[1].drain()
    for reader, writer in (silent, half):
        answer = await until_closed(reader)
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b'"code":"request_timeout"' in answer
        writer.close()


async def test_a_body_that_stops_is_cut_and_one_sent_slowly_is_not(h: Harness, port: int) -> None:
    body = b'{"payload": {"n": 1}}'
    head = (f"POST /api/v1/tasks/hello/trigger HTTP/1.1\r\nhost: t\r\nauthorization: Bearer {h.env.api_key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + body[:5])
    await writer.drain()
    assert await until_closed(reader) == b""  # cut, no answer (its handler read a disconnect)
    writer.close()
    # a body a few bytes at a time, each well within the idle time, is taken
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    for i in range(len(body)):
        writer.write(body[i:i + 1])
        await writer.drain()
        await asyncio.sleep(0.05)
    answer = await until_closed(reader)
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    writer.close()
    deadline = time.monotonic() + 30
    while len(slow_requests.SLOW):  # nothing left watched once the connections are gone
        assert time.monotonic() < deadline, "a request left watched"
        await asyncio.sleep(0.02)
