"""Payloads sent as JSON text (Trigger.dev's SDK sends them so) and large request bodies are decoded
and walked off the event loop, and a text over the payload limit is refused before it is decoded:
one tenant's three requests of a million empty lists held every tenant's requests for seconds."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import orjson
import pytest

from run_engine.api import http

from .conftest import Harness


@pytest.fixture
def decoded_where(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Where each payload text was decoded: "loop" (the event loop's thread) or "thread"."""
    where: list[str] = []
    decode = http.decode_json_text

    def recorded(text: str, payload_type: str, field: str) -> Any:
        where.append("loop" if threading.current_thread() is threading.main_thread() else "thread")
        return decode(text, payload_type, field)

    monkeypatch.setattr(http, "decode_json_text", recorded)
    return where


async def test_a_large_payload_text_is_decoded_off_the_event_loop(h: Harness, api: httpx.AsyncClient,
                                                                  decoded_where: list[str]) -> None:
    await h.deploy({"id": "hello"})
    big = orjson.dumps([[] for _ in range(150_000)]).decode()  # 450 KB of empty lists
    made = await api.post("/api/v1/tasks/hello/trigger", json={"payload": big,
                                                               "options": {"payloadType": "application/json"}})
    assert made.status_code == 200, made.text
    small = await api.post("/api/v1/tasks/hello/trigger", json={"payload": '{"a": 1}',
                                                                 "options": {"payloadType": "application/json"}})
    assert small.status_code == 200, small.text
    batch = await api.post("/api/v1/tasks/batch", json={"items": [
        {"task": "hello", "payload": big, "options": {"payloadType": "application/json"}}]})
    assert batch.status_code == 200, batch.text
    assert decoded_where == ["thread", "loop", "thread"]
    run = await h.engine.get_run(made.json()["id"])
    assert run is not None and len(run.payload) == 150_000


async def test_a_payload_text_over_the_limit_is_refused_before_it_is_decoded(
        h: Harness, api: httpx.AsyncClient, decoded_where: list[str]) -> None:
    await h.deploy({"id": "hello"})
    limit = h.engine.resources.settings.max_payload_bytes
    over = "[" + ",".join(["[]"] * (limit // 3 + 10)) + "]"
    assert len(over) > limit
    item = {"payload": over, "options": {"payloadType": "application/json"}}
    for path, body in [("/api/v1/tasks/hello/trigger", item),
                       ("/api/v1/tasks/batch", {"items": [{"task": "hello", **item}]})]:
        refused = await api.post(path, json=body)
        assert refused.status_code == 413, refused.text
        assert refused.json()["error"]["code"] == "payload_too_large"
    assert decoded_where == []
    bad = await api.post("/api/v1/tasks/hello/trigger", json={"payload": "{nope",
                                                               "options": {"payloadType": "application/json"}})
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]


async def test_a_large_body_is_decoded_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    where: list[str] = []
    loads = orjson.loads

    def recorded(data: Any) -> Any:
        where.append("loop" if threading.current_thread() is threading.main_thread() else "thread")
        return loads(data)

    monkeypatch.setattr(http.orjson, "loads", recorded)

    class Request:
        def __init__(self, body: bytes) -> None:
            self.body = body
            self.headers: dict[str, str] = {}

        async def stream(self) -> Any:
            yield self.body

    big = orjson.dumps({"payload": [[] for _ in range(150_000)]})
    assert len((await http.read_json(Request(big)))["payload"]) == 150_000  # type: ignore[arg-type]
    assert (await http.read_json(Request(b'{"a": 1}'))) == {"a": 1}  # type: ignore[arg-type]
    assert where == ["thread", "loop"]
