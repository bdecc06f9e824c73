"""Payloads sent as JSON text (Trigger.dev's SDK sends them so) and large request bodies are decoded
and walked off the event loop, and a text over the payload limit is refused before it is decoded:
one tenant's three requests of a million empty lists held every tenant's requests for seconds."""

from __future__ import annotations

import gc
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


async def test_a_body_of_too_many_containers_is_refused_before_it_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """orjson holds the GIL whatever thread decodes: a body's objects and arrays are counted first,
    and a large body is decoded with the collector paused."""
    from run_engine import jsontext

    decoded: list[bool] = []
    loads = orjson.loads

    def recorded(data: Any) -> Any:
        decoded.append(gc.isenabled())
        return loads(data)

    monkeypatch.setattr(jsontext.orjson, "loads", recorded)
    monkeypatch.setattr(http, "MAX_BODY_CONTAINERS", 200_000)

    class Request:
        def __init__(self, body: bytes) -> None:
            self.body = body
            self.headers: dict[str, str] = {}

        async def stream(self) -> Any:
            yield self.body

    big = orjson.dumps({"payload": [[] for _ in range(150_000)]})
    assert len((await http.read_json(Request(big)))["payload"]) == 150_000  # type: ignore[arg-type]
    assert decoded == [False] and gc.isenabled()
    with pytest.raises(http.ApiError) as refused:
        await http.read_json(Request(orjson.dumps([[] for _ in range(200_001)])))  # type: ignore[arg-type]
    assert refused.value.status == 413 and "200002 JSON objects and arrays" in refused.value.message
    assert decoded == [False]  # never decoded


async def test_a_batch_of_many_small_payload_texts_is_decoded_in_one_thread(
        h: Harness, api: httpx.AsyncClient, decoded_where: list[str]) -> None:
    """Each text under the bound, together over it: all decoded (and walked) in a thread, not one
    after another on the loop."""
    await h.deploy({"id": "hello"})
    text = orjson.dumps([[] for _ in range(20_000)]).decode()  # 60 KB each, 300 KB in all
    items = [{"task": "hello", "payload": text, "options": {"payloadType": "application/json"}} for _ in range(5)]
    made = await api.post("/api/v1/tasks/batch", json={"items": items})
    assert made.status_code == 200, made.text
    assert decoded_where == ["thread"] * 5
    small = await api.post("/api/v1/tasks/batch", json={"items": items[:2]})
    assert small.status_code == 200 and decoded_where == ["thread"] * 5 + ["loop"] * 2


async def test_a_streamed_batch_is_parsed_in_a_thread_and_a_line_of_too_many_containers_refused(
        h: Harness, api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    from run_engine.api import batch_lines, batches

    await h.deploy({"id": "hello"})
    where: list[str] = []
    read = batches.read_lines

    def recorded(raw: Any, size: int) -> Any:
        where.append("loop" if threading.current_thread() is threading.main_thread() else "thread")
        return read(raw, size)

    monkeypatch.setattr(batches, "read_lines", recorded)
    opened = (await api.post("/api/v3/batches", json={"runCount": 2})).json()
    line = orjson.dumps({"index": 0, "task": "hello", "payload": [[] for _ in range(100_000)]})
    sent = await api.post(f"/api/v3/batches/{opened['id']}/items", content=line + b"\n")
    assert sent.status_code == 200, sent.text
    assert where == ["thread"]
    monkeypatch.setattr(batch_lines, "MAX_CONTAINERS", 1000)
    many = orjson.dumps({"index": 1, "task": "hello", "payload": [[] for _ in range(2001)]})
    refused = await api.post(f"/api/v3/batches/{opened['id']}/items", content=many + b"\n")
    # refused before it is parsed, as its item's failure (its index is read from the line's start)
    assert refused.status_code == 200, refused.text
    (error,) = refused.json()["errors"]
    assert error["errorCode"] == "payload_too_large" and "line 1" in error["error"]
    assert (error["line"], error["index"], error["taskIdentifier"]) == (1, 1, "hello")
