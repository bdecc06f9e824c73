"""A stored value (a payload, an output, a step's result, a token's data) holds at most
MAX_CONTAINERS objects and arrays: every read of a run decodes its payload on the event loop that
every tenant's requests share, and a 3 MiB payload of a million empty lists took half a second a
read. Large stored values are decoded with the cycle collector paused."""

from __future__ import annotations

import gc
from typing import Any

import httpx
import orjson
import pytest

from run_engine import jsontext
from run_engine.api import inputs
from run_engine.db import repository

from .conftest import Harness, api_client


async def test_a_payload_of_too_many_containers_is_refused(h: Harness, api: httpx.AsyncClient,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inputs, "MAX_CONTAINERS", 1000)
    await h.deploy({"id": "hello"})
    many = [[] for _ in range(1001)]
    for payload, options in [(orjson.dumps(many).decode(), {"payloadType": "application/json"}), (many, None)]:
        refused = await api.post("/api/v1/tasks/hello/trigger", json={"payload": payload, "options": options or {}})
        assert refused.status_code == 413, refused.text
        assert "1002 JSON objects and arrays" in refused.json()["error"]["message"]
    fine = await api.post("/api/v1/tasks/hello/trigger", json={"payload": many[:900]})
    assert fine.status_code == 200, fine.text
    meta = await api.post("/api/v1/tasks/hello/trigger", json={"payload": 1, "options": {"metadata": {"m": many}}})
    assert meta.status_code == 413 and "options.metadata" in meta.json()["error"]["message"]


async def test_an_output_of_too_many_containers_fails_its_run(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    from run_engine.api.app import create_app
    from run_engine.api.context import ApiContext
    from run_engine.engine import TriggerRequest
    from run_engine.run_tokens import RunTokens
    from run_engine.wakeups import WakeUps

    monkeypatch.setattr(inputs, "MAX_CONTAINERS", 1000)
    await h.deploy({"id": "hello"})
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1, start=True)
    assert d.started is not None
    prefix = h.engine.resources.settings.key_prefix
    ctx = ApiContext(engine=h.engine, tokens=RunTokens("test-secret"), public_url="http://t",
                     wakeups=WakeUps(h.engine.redis, channel=f"{prefix}:wake"), secret="test-secret")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)),
                                 base_url="http://t/engine/v1/worker-actions",
                                 headers={"Authorization": f"Bearer {h.env.worker_group_token}"}) as worker:
        done = await worker.post(f"/runs/{run.id}/snapshots/{d.started.snapshot.id}/attempts/complete",
                                 json={"ok": True, "output": [[] for _ in range(1001)]})
    assert done.status_code == 200, done.text
    row = await h.engine.get_run(run.id)
    assert row is not None and row.status == "FAILED" and row.error is not None
    assert row.error["type"] == "OUTPUT_NOT_STORABLE" and "JSON objects and arrays" in row.error["message"]


def test_a_large_stored_value_is_decoded_with_the_collector_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    loads = orjson.loads

    def recorded(data: bytes | str) -> object:
        seen.append(gc.isenabled())
        return loads(data)

    monkeypatch.setattr(jsontext.orjson, "loads", recorded)
    big = orjson.dumps([[] for _ in range(30_000)])
    assert repository._loads(big) == [[] for _ in range(30_000)] and repository._loads(b"[1]") == [1]
    assert seen == [False, True] and gc.isenabled()
    gc.disable()
    try:  # paused by someone else: left paused
        assert repository._loads(big) is not None and not gc.isenabled()
    finally:
        gc.enable()


async def test_numbers_in_exponent_form_count_as_postgresql_writes_them_out(make_engine: Any) -> None:
    """jsonb keeps a number as a decimal and gives it back written out in full: 1e+308 (6 bytes of
    JSON) is read back as 309 digits. A payload of them within the payload limit came back as 50
    times the limit (a 3 MiB payload: 137 MB of text decoded at every read of the run, seconds of
    the event loop every tenant shares); metadata within its limit the same. The limits now count a
    value as it is stored (an upper bound from its exponents, checked against PostgreSQL here)."""
    h: Harness = await make_engine(max_payload_bytes=64 * 1024, max_metadata_bytes=16 * 1024)
    await h.deploy({"id": "hello"})
    values: list[Any] = [1e308, -5e-324, 1.2345678901234567e19, 1e16, -1.5e-7, {"a": [1e-300, 2.5e+200]}, 1e300,
                         "x,1e+5,", [1.7976931348623157e308, 0.1, 12345678901234567890]]
    async with h.engine.resources.repo.pool.connection() as conn:
        for value in values:
            raw = orjson.dumps(value)
            cur = await conn.execute("SELECT octet_length(%s::jsonb::text)", (raw.decode(),))
            written = (await cur.fetchone())[0]  # type: ignore[index]
            assert jsontext.stored_size(raw, 0) >= written, value  # limit 0: measured, not the cheap bound
    async with api_client(h) as api:
        huge = [1e308] * 1000  # 6 KB of JSON, 309 KB as stored
        refused = await api.post("/api/v1/tasks/hello/trigger", json={"payload": huge})
        assert refused.status_code == 413, refused.text
        assert refused.json()["error"]["message"].startswith("payload: larger than 65536 bytes as stored")
        text = await api.post("/api/v1/tasks/hello/trigger", json={"payload": orjson.dumps(huge).decode(),
                                                                   "options": {"payloadType": "application/json"}})
        assert text.status_code == 413, text.text
        meta = await api.post("/api/v1/tasks/hello/trigger", json={"payload": 1, "options": {"metadata": {
            "m": [1e308] * 100}}})
        assert meta.status_code == 413 and "options.metadata" in meta.json()["error"]["message"]
        # an ordinary value near the limit is taken, however many "e-" and UUIDs it holds
        ordinary = {"text": "one-time re-run " * 2500, "ids": ["550e8400-e29b-41d4-a716-44665544000" + str(i % 10)
                                                              for i in range(500)], "n": [1e-7, 2.5e16] * 100}
        assert 60_000 < len(orjson.dumps(ordinary)) < 64 * 1024
        run = await api.post("/api/v1/tasks/hello/trigger", json={"payload": ordinary})
        assert run.status_code == 200, run.text
        run_id = run.json()["id"]
        replaced = await api.put(f"/api/v1/runs/{run_id}/metadata", json={"metadata": {"m": [1e308] * 100}})
        assert replaced.status_code == 413, replaced.text
        changed = await api.put(f"/api/v1/runs/{run_id}/metadata", json={"operations": [
            {"type": "set", "key": "m", "value": [1e308] * 100}]})
        assert changed.status_code == 413, changed.text
        fits = await api.put(f"/api/v1/runs/{run_id}/metadata", json={"metadata": {"m": [1e308] * 10}})
        assert fits.status_code == 200, fits.text
