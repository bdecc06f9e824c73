"""A client that asks for a large answer and never reads it gives the server's memory back: the
server (its own protocol, on uvicorn) cuts a connection whose unsent bytes stop going out
(run_engine/api/stalls.py). Before, the answer stayed buffered in the server for as long as the
connection stayed open: 100 such connections held 800 MB of one server process."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import pytest
import uvicorn

from run_engine.api import stalls
from run_engine.api.app import create_app
from run_engine.api.context import ApiContext
from run_engine.engine import TriggerRequest
from run_engine.run_tokens import RunTokens
from run_engine.server import _http_protocol
from run_engine.wakeups import WakeUps

from .conftest import Harness

MIB = 1024 * 1024


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def served(h: Harness) -> AsyncIterator[uvicorn.Server]:
    """The API over the harness's engine on a real uvicorn socket with the server's own protocol
    (its port: ``.config.port``)."""
    ctx = ApiContext(engine=h.engine, tokens=RunTokens("test-secret"),
                     wakeups=WakeUps(h.engine.redis, channel=f"{h.engine.resources.settings.key_prefix}:wake"),
                     public_url="http://t", secret="test-secret")
    port = _port()
    server = uvicorn.Server(uvicorn.Config(create_app(ctx), host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False, log_config=None, lifespan="off",
                                           timeout_graceful_shutdown=1, http=_http_protocol()))
    serving = asyncio.ensure_future(server.serve())
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and not serving.done()
            await asyncio.sleep(0.02)
        yield server
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 30)


async def test_an_answer_nobody_reads_is_cut_and_one_read_slowly_is_not(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stalls.STALLS, "stall_s", 1.0)
    monkeypatch.setattr(stalls.STALLS, "check_s", 0.2)
    await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", payload="p" * (2 * MIB))
                                 for _ in range(4)])  # a page of them: ~8 MiB, past the kernel's buffers
    async with served(h) as server:
        port = server.config.port
        request = (f"GET /api/v1/runs?page%5Bsize%5D=100 HTTP/1.1\r\nhost: t\r\n"
                   f"authorization: Bearer {h.env.api_key}\r\nconnection: close\r\n\r\n").encode()

        async def ask(small: bool) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=64 * 1024)
            if small:  # the kernel on the client's side takes little of what it does not read
                writer.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            writer.write(request)
            await writer.drain()
            return reader, writer

        # a client that never reads: watched, then cut on the server's side (its buffers freed)
        dead_reader, dead_writer = await ask(small=True)
        deadline = time.monotonic() + 30
        while not len(stalls.STALLS):
            assert time.monotonic() < deadline, "the unread answer was never watched"
            await asyncio.sleep(0.05)
        deadline = time.monotonic() + 60
        while len(stalls.STALLS) or server.server_state.connections:
            assert time.monotonic() < deadline, "the unread answer was never cut"
            await asyncio.sleep(0.05)
        dead_writer.close()
        # a reader that reads a little at a time, pausing (each pause well within the stall time),
        # gets its answer whole
        slow_reader, slow_writer = await ask(small=False)
        got = 0
        while chunk := await asyncio.wait_for(slow_reader.read(64 * 1024), 30):
            got += len(chunk)
            await asyncio.sleep(0.01)
        assert got > 8 * MIB, got
        slow_writer.close()
