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

from run_engine.api import slow_requests

from .conftest import Harness
from .test_unread_answers import served


@pytest.fixture
async def port(h: Harness, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[int]:
    for name, value in (("head_s", 1.0), ("body_idle_s", 2.0), ("body_s", 30.0), ("check_s", 0.1)):
        monkeypatch.setattr(slow_requests.SLOW, name, value)
    async with served(h) as server:
        yield server.config.port


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
