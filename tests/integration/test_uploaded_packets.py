"""A payload uploaded before its trigger, as Trigger.dev's SDK sends one of 128 KiB or more: a signed
upload URL, the upload, then a trigger (or a batch item) naming it as `application/store`. The
packet is the environment's own, bounded like any payload, and deleted once expired."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, cast
from urllib.parse import urlsplit

import httpx
import orjson
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from run_engine.api import uploads
from run_engine.db.packets import PacketRepository
from run_engine.tenancy import ensure_environment

from .conftest import Harness

STORE = "application/store"


async def upload(api: httpx.AsyncClient, name: str, body: bytes, content_type: str = "application/json",
                 headers: dict[str, str] | None = None) -> str:
    """What the SDK's exportPacket does: ask for a URL, PUT the packet there with no credential."""
    made = await api.put(f"/api/v2/packets/{name}", headers=headers)
    assert made.status_code == 200, made.text
    url = urlsplit(made.json()["presignedUrl"])
    assert url.netloc == "t"
    put = await api.put(f"{url.path}?{url.query}", content=body,
                        headers={"Authorization": "", "Content-Type": content_type})
    assert put.status_code == 200, put.text
    path: str = made.json()["storagePath"]
    return path


async def run_payload(api: httpx.AsyncClient, run_id: str) -> Any:
    return (await api.get(f"/api/v3/runs/{run_id}")).json()["payload"]


async def test_a_trigger_names_an_uploaded_payload(h: Harness, api: httpx.AsyncClient) -> None:
    big = {"text": "x" * 200_000, "n": 1}
    path = await upload(api, "trigger/hello/1-abc/payload.json", orjson.dumps(big))
    assert path.endswith("/trigger/hello/1-abc/payload.json")
    made = await api.post("/api/v1/tasks/hello/trigger", json={"payload": path, "options": {"payloadType": STORE}})
    assert made.status_code == 200, made.text
    assert await run_payload(api, made.json()["id"]) == big
    # superjson, as the SDK sends a payload holding dates: decoded as an inline one would be
    sj = await upload(api, "p.json", orjson.dumps({"json": {"when": "1970-01-01T00:00:00.000Z"}, "meta": {}}),
                      "application/super+json")
    made = await api.post("/api/v1/tasks/hello/trigger", json={"payload": sj, "options": {"payloadType": STORE}})
    assert await run_payload(api, made.json()["id"]) == {"when": "1970-01-01T00:00:00.000Z"}


async def test_batch_items_name_uploaded_payloads_in_every_batch_route(h: Harness, api: httpx.AsyncClient) -> None:
    one = await upload(api, "a/payload.json", orjson.dumps({"i": 1}))
    two = await upload(api, "b/payload.json", orjson.dumps({"i": 2}))
    batch = await api.post("/api/v1/tasks/batch", json={"items": [
        {"task": "hello", "payload": one, "options": {"payloadType": STORE}},
        {"task": "hello", "payload": {"i": 3}},
        {"task": "hello", "payload": two, "options": {"payloadType": STORE}}]})
    assert batch.status_code == 200, batch.text
    assert [await run_payload(api, r["id"]) for r in batch.json()["runs"]] == [{"i": 1}, {"i": 3}, {"i": 2}]
    opened = (await api.post("/api/v3/batches", json={"runCount": 1})).json()
    line = orjson.dumps({"index": 0, "task": "hello", "payload": two, "options": {"payloadType": STORE}})
    streamed = await api.post(f"/api/v3/batches/{opened['id']}/items", content=line,
                              headers={"Content-Type": "application/x-ndjson"})
    assert streamed.json()["sealed"] is True
    (run_id,) = (await api.get(f"/api/v1/batches/{opened['id']}")).json()["runs"]
    assert await run_payload(api, run_id) == {"i": 2}
    missing = await api.post("/api/v1/tasks/batch", json={"items": [
        {"task": "hello", "payload": {"i": 1}}, {"task": "hello", "payload": "uploads/nope/x.json",
                                                 "options": {"payloadType": STORE}}]})
    assert missing.status_code == 400 and "items.1.payload" in missing.json()["error"]["message"]


async def test_an_upload_is_the_environments_own_signed_and_bounded(h: Harness, api: httpx.AsyncClient) -> None:
    path = await upload(api, "mine.json", b'{"secret": 1}')
    other = await ensure_environment(h.engine.resources.repo, secret="test-secret", org="other-org", project="p",
                                     env="dev")
    theirs = await api.post("/api/v1/tasks/hello/trigger", json={"payload": path, "options": {"payloadType": STORE}},
                            headers={"Authorization": f"Bearer {other.api_key}"})
    assert theirs.status_code == 400 and "no uploaded packet" in theirs.json()["error"]["message"]
    for payload in (7, "", "x" * 5000):
        bad = await api.post("/api/v1/tasks/hello/trigger",
                             json={"payload": payload, "options": {"payloadType": STORE}})
        assert bad.status_code == 400, payload
    made = (await api.put("/api/v2/packets/next.json")).json()
    url = urlsplit(made["presignedUrl"])
    no_auth = {"Authorization": "", "Content-Type": "application/json"}
    forged = url.query.replace("signature=", "signature=x")
    assert (await api.put(f"{url.path}?{forged}", content=b"1", headers=no_auth)).status_code == 403
    elsewhere = url.path.replace(made["storagePath"], "uploads/other/next.json")  # the signature names the path
    assert (await api.put(f"{elsewhere}?{url.query}", content=b"1", headers=no_auth)).status_code == 403
    wrong_type = await api.put(f"{url.path}?{url.query}", content=b"1",
                               headers={"Authorization": "", "Content-Type": "application/octet-stream"})
    assert wrong_type.status_code == 400
    assert (await api.put(f"{url.path}?{url.query}", content=b'"\x00"', headers=no_auth)).status_code == 400
    assert (await api.put(f"{url.path}?{url.query}", content=b"\xff", headers=no_auth)).status_code == 400
    limit = h.engine.settings.max_payload_bytes
    too_long = b"1" * (2 * limit + 1)
    assert (await api.put(f"{url.path}?{url.query}", content=too_long, headers=no_auth)).status_code == 413
    # within the upload's bound but over the payload limit once decoded: the trigger refuses it
    ok = await api.put(f"{url.path}?{url.query}", content=b'"' + b"y" * (limit + 10) + b'"', headers=no_auth)
    assert ok.status_code == 200
    too_big = await api.post("/api/v1/tasks/hello/trigger",
                             json={"payload": made["storagePath"], "options": {"payloadType": STORE}})
    assert too_big.status_code == 413
    for name in ("x" * (uploads.MAX_NAME + 1), "a%07b", "a/%2E%2E/b.json", "%2E/b.json"):
        assert (await api.put(f"/api/v2/packets/{name}")).status_code == 400, name
    scoped = (await api.post("/api/v1/auth/public-tokens", json={"scopes": ["read:runs"]})).json()["token"]
    assert (await api.put("/api/v2/packets/p.json", headers={"Authorization": f"Bearer {scoped}"})).status_code == 403
    may = (await api.post("/api/v1/auth/public-tokens", json={"scopes": ["trigger:tasks:hello"]})).json()["token"]
    assert (await api.put("/api/v2/packets/p.json", headers={"Authorization": f"Bearer {may}"})).status_code == 200
    h.clock.advance(uploads.URL_TTL_S + 1)  # the URL expires
    assert (await api.put(f"{url.path}?{url.query}", content=b"1", headers=no_auth)).status_code == 403


async def test_expired_packets_are_not_used_and_are_deleted(h: Harness, api: httpx.AsyncClient) -> None:
    path = await upload(api, "old.json", b'{"old": true}')
    repo = h.engine.resources.repo
    async with repo.pool.connection() as conn:  # an hour later (the database's clock: not the fake one)
        await conn.execute("UPDATE uploaded_packet SET expires_at = now() - interval '1 second' WHERE path = %s",
                           (path,))
    late = await api.post("/api/v1/tasks/hello/trigger", json={"payload": path, "options": {"payloadType": STORE}})
    assert late.status_code == 400
    assert await h.engine.systems.reconciler.retention() >= 1
    async with repo.pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) FROM uploaded_packet WHERE path = %s", (path,))
        assert (await cur.fetchone())[0] == 0  # type: ignore[index]


async def test_a_string_payload_uploads_as_text(h: Harness, api: httpx.AsyncClient) -> None:
    path = await upload(api, "s/payload.txt", b"plain words " * 20_000, "text/plain")
    made = await api.post("/api/v1/tasks/hello/trigger", json={"payload": path, "options": {"payloadType": STORE}})
    assert made.status_code == 200, made.text
    assert await run_payload(api, made.json()["id"]) == "plain words " * 20_000


async def test_naming_one_packet_many_times_is_bounded_like_an_inline_body(h: Harness, api: httpx.AsyncClient) -> None:
    path = await upload(api, "big.json", orjson.dumps("b" * 3_000_000))
    items = [{"task": "hello", "payload": path, "options": {"payloadType": STORE}} for _ in range(4)]
    fanned = await api.post("/api/v1/tasks/batch", json={"items": items})  # a few hundred bytes naming 12 MB
    assert fanned.status_code == 413 and "items.3.payload" in fanned.json()["error"]["message"]
    three = await api.post("/api/v1/tasks/batch", json={"items": items[:3]})
    assert three.status_code == 200, three.text


async def test_a_one_time_token_is_spent_by_the_trigger_not_by_its_upload(h: Harness, api: httpx.AsyncClient) -> None:
    token = (await api.post("/api/v1/auth/public-tokens",
                            json={"scopes": ["trigger:tasks:hello"], "oneTimeUse": True})).json()["token"]
    path = await upload(api, "once.json", b'{"once": 1}', headers={"Authorization": f"Bearer {token}"})
    made = await api.post("/api/v1/tasks/hello/trigger", json={"payload": path, "options": {"payloadType": STORE}},
                          headers={"Authorization": f"Bearer {token}"})
    assert made.status_code == 200, made.text
    again = await api.post("/api/v1/tasks/hello/trigger", json={"payload": 1},
                           headers={"Authorization": f"Bearer {token}"})
    assert again.status_code == 401  # spent once, by the trigger


async def test_an_environments_waiting_uploads_are_capped(h: Harness, api: httpx.AsyncClient,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import run_engine.engine as engine_module

    monkeypatch.setattr(engine_module, "PACKET_BYTES_PER_ENV", 250)
    monkeypatch.setattr(engine_module, "PACKET_MIN_BYTES", 100)  # each of these counts 100 (53 bytes with its path)
    await upload(api, "one.json", b'"0123456789"')
    await upload(api, "two.json", b'"0123456789"')
    made = (await api.put("/api/v2/packets/three.json")).json()
    url = urlsplit(made["presignedUrl"])
    full = await api.put(f"{url.path}?{url.query}", content=b'"0123456789"',
                         headers={"Authorization": "", "Content-Type": "application/json"})
    assert full.status_code == 429 and "expire" in full.json()["error"]["message"]


async def test_empty_uploads_count_against_the_cap(h: Harness, api: httpx.AsyncClient,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A packet counts as PACKET_MIN_BYTES at least: empty uploads (or ones of a byte, under names
    of 512 characters) counted nothing or next to nothing, and a tenant could keep millions of rows
    that every one of its uploads then added up."""
    import run_engine.engine as engine_module

    monkeypatch.setattr(engine_module, "PACKET_BYTES_PER_ENV", 3 * engine_module.PACKET_MIN_BYTES)
    for i in range(3):
        await upload(api, f"{i}.json", b"")
    made = (await api.put("/api/v2/packets/3.json")).json()
    url = urlsplit(made["presignedUrl"])
    full = await api.put(f"{url.path}?{url.query}", content=b"",
                         headers={"Authorization": "", "Content-Type": "application/json"})
    assert full.status_code == 429, full.text


async def test_uploads_at_once_never_pass_the_cap_together(h: Harness, database_url: str) -> None:
    """The check of the cap and the write are one step per environment: an upload running beside
    another (its row written, not yet committed) waits for it and counts its row; before, each read
    the sum without the other's and both were stored, past the cap."""
    packets = h.engine.resources.repo.packets
    env = h.env.env_id
    cap, each = 150, 100  # one packet fits, two do not

    async with await psycopg.AsyncConnection.connect(database_url) as other:
        class Held:  # the other upload's connection, its transaction left open
            @contextlib.asynccontextmanager
            async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
                yield other

        await other.execute("SELECT 1")  # the transaction the other upload is made (and held) in
        assert await PacketRepository(cast(AsyncConnectionPool, Held())).put(env, "one.json", "application/json",
                                                                            '"1"', 3600, cap, each)
        mine = (await (await other.execute("SELECT pg_backend_pid()")).fetchone() or [0])[0]
        second = asyncio.ensure_future(packets.put(env, "two.json", "application/json", '"2"', 3600, cap, each))
        deadline = time.monotonic() + 30
        while not second.done():  # until the second is done, or waits for the first
            cur = await other.execute("SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
                                      (mine,))
            if (await cur.fetchone() or [0])[0]:
                break
            assert time.monotonic() < deadline, "the second upload neither ended nor waited"
            await asyncio.sleep(0.01)
        await other.commit()
        stored = await second
    assert not stored  # refused: the two would pass the cap
    assert set(await packets.get_many(env, ["one.json", "two.json"])) == {"one.json"}
