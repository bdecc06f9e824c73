"""A realtime shape is bounded in bytes whatever its runs hold: payloads and outputs inline only while
small and within the answer's budget, the others as `application/store` references that a signed URL
serves (as Trigger.dev's SDK fetches a packet it keeps in object storage); errors cut short."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import pytest

from run_engine.api import packets, shape_stream
from run_engine.db.runs import _RUN_PACKETS, SHAPE_ERROR_CHARS
from run_engine.engine import TriggerRequest
from run_engine.tenancy import ensure_environment

from .conftest import Harness

ITEM, BUDGET = 1000, 2500


@pytest.fixture
def client(api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> httpx.AsyncClient:
    monkeypatch.setattr(shape_stream, "PACKET_INLINE_BYTES", ITEM)
    monkeypatch.setattr(shape_stream, "ANSWER_INLINE_BYTES", BUDGET)
    return api


async def trigger(h: Harness, payloads: list[Any], tags: list[str]) -> list[str]:
    runs = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=p,
                                                       tags=tuple(tags)) for p in payloads])
    return [r.id for r in runs]


def values(answer: httpx.Response) -> dict[str, dict[str, Any]]:
    assert answer.status_code == 200, answer.text
    return {m["value"]["id"]: m["value"] for m in answer.json() if "value" in m}


async def fetched(client: httpx.AsyncClient, url_answer: httpx.Response) -> httpx.Response:
    """What the SDK does with a packet URL: fetch it with no credential."""
    assert url_answer.status_code == 200, url_answer.text
    url = urlsplit(url_answer.json()["presignedUrl"])
    assert url.netloc == "t"  # the server's public URL
    return await client.get(f"{url.path}?{url.query}", headers={"Authorization": ""})


async def test_a_tag_shape_sends_small_packets_inline_within_its_budget_and_the_rest_by_reference(
        h: Harness, client: httpx.AsyncClient) -> None:
    small = ["s" * 600, "t" * 600, "u" * 600, "v" * 600, "w" * 600]  # ~602 bytes of JSON each: four fit in 2,500
    big = {"big": "b" * 5000}
    ids = await trigger(h, [*small, big, None], ["shape"])
    got = values(await client.get("/realtime/v1/runs", params={"tags": "shape", "offset": "-1"}))
    assert set(got) == set(ids)  # every run, whatever its size: a live shape never leaves one out
    sent_in = [got[i] for i in await newest_first(h)]
    inline = [v for v in sent_in if v["payloadType"] == "application/json" and v["payload"] is not None]
    stored = [v for v in sent_in if v["payloadType"] == shape_stream.STORE]
    assert sum(len(v["payload"]) for v in inline) <= BUDGET and len(inline) == 4
    assert got[ids[5]] in stored and got[ids[5]]["payload"] == f"{ids[5]}/payload.json"
    assert got[ids[6]]["payload"] is None and got[ids[6]]["payloadType"] == "application/json"  # none at all
    for v in inline:
        assert orjson.loads(v["payload"]) in small
    for v in stored:  # each one by its URL, as the SDK's getRunPacketUrl and its fallback ask
        body = await fetched(client, await client.get(f"/api/v1/runs/{v['id']}/packets/payload"))
        assert body.status_code == 200 and body.headers["content-type"].startswith("application/json")
        again = await fetched(client, await client.get(f"/api/v1/packets/{v['id']}/payload.json"))
        assert orjson.loads(body.content) == orjson.loads(again.content) == (
            big if v["id"] == ids[5] else small[ids.index(v["id"])])


async def newest_first(h: Harness) -> list[str]:
    return [r.id for r in await h.engine.list_runs(h.env.env_id, limit=100, light=True)]


async def test_outputs_go_by_reference_too_and_errors_are_cut_short(h: Harness, client: httpx.AsyncClient) -> None:
    ok, failed = await trigger(h, [1, 2], ["done"])
    got = await h.engine.dequeue(h.env.worker_group_id, 2, "w", start=True)
    by_id = {d.run.id: d for d in got}
    await h.engine.complete_attempt(ok, by_id[ok].started.snapshot.id, ok=True, output={"o": "x" * 3000})
    await h.engine.complete_attempt(failed, by_id[failed].started.snapshot.id, ok=False, retryable=False,
                                    error={"type": "BUILT_IN_ERROR", "name": "Boom", "message": "m" * 50_000,
                                           "stackTrace": "at " * 20_000})
    shown = values(await client.get("/realtime/v1/runs", params={"tags": "done", "offset": "-1"}))
    assert shown[ok]["outputType"] == shape_stream.STORE and shown[ok]["output"] == f"{ok}/output.json"
    body = await fetched(client, await client.get(f"/api/v1/runs/{ok}/packets/output"))
    assert orjson.loads(body.content) == {"o": "x" * 3000}
    error = shown[failed]["error"]
    assert error["name"] == "Boom" and error["message"] == "m" * SHAPE_ERROR_CHARS
    assert len(error["stackTrace"]) == SHAPE_ERROR_CHARS and shown[failed]["output"] is None
    one = values(await client.get(f"/realtime/v1/runs/{ok}", params={"offset": "-1"}))  # the one-run shape too
    assert one[ok]["outputType"] == shape_stream.STORE and one[ok]["payload"] == "1"


async def test_a_packet_url_is_signed_for_one_packet_expires_and_stays_in_its_environment(
        h: Harness, client: httpx.AsyncClient) -> None:
    (run_id,) = await trigger(h, [{"p": "q" * 2000}], ["mine"])
    answer = await client.get(f"/api/v1/runs/{run_id}/packets/payload")
    url = urlsplit(answer.json()["presignedUrl"])
    assert (await client.get(f"{url.path}?{url.query}", headers={"Authorization": ""})).status_code == 200
    forged = url.query.replace("signature=", "signature=x")
    assert (await client.get(f"{url.path}?{forged}", headers={"Authorization": ""})).status_code == 403
    other_field = url.path.replace("/payload", "/output")  # the signature names the field
    assert (await client.get(f"{other_field}?{url.query}", headers={"Authorization": ""})).status_code == 403
    (sibling,) = await trigger(h, [{"p": "other"}], ["mine"])
    other_run = url.path.replace(run_id, sibling)  # and the run
    assert (await client.get(f"{other_run}?{url.query}", headers={"Authorization": ""})).status_code == 403
    for forged_expiry in (url.query.replace("expires=", "expires=9"), url.query.replace("expires=", "expires=x")):
        assert (await client.get(f"{url.path}?{forged_expiry}", headers={"Authorization": ""})).status_code == 403
    h.clock.advance(packets.URL_TTL_S + 1)
    assert (await client.get(f"{url.path}?{url.query}", headers={"Authorization": ""})).status_code == 403
    for bad in ("/api/v1/runs/run_nope/packets/payload", f"/api/v1/runs/{run_id}/packets/metadata",
                f"/api/v1/packets/{run_id}/payload.txt", f"/api/v1/packets/x/{run_id}/payload.json"):
        assert (await client.get(bad)).status_code == 404, bad
    no_output = await fetched(client, await client.get(f"/api/v1/runs/{run_id}/packets/output"))
    assert no_output.status_code == 404  # not finished: no output to serve
    other = await ensure_environment(h.engine.resources.repo, secret="test-secret", org="other-org", project="p",
                                     env="dev")
    theirs = await client.get(f"/api/v1/runs/{run_id}/packets/payload",
                              headers={"Authorization": f"Bearer {other.api_key}"})
    assert theirs.status_code == 404  # another environment's run: not found, as everywhere
    scoped = (await client.post("/api/v1/auth/public-tokens", json={"scopes": ["read:runs:run_other"]})).json()
    denied = await client.get(f"/api/v1/runs/{run_id}/packets/payload",
                              headers={"Authorization": f"Bearer {scoped['token']}"})
    assert denied.status_code == 403
    allowed = (await client.post("/api/v1/auth/public-tokens", json={"scopes": ["read:tags:mine"]})).json()
    assert (await client.get(f"/api/v1/runs/{run_id}/packets/payload",
                             headers={"Authorization": f"Bearer {allowed['token']}"})).status_code == 200


async def test_skipped_columns_are_left_out_and_unread(h: Harness, client: httpx.AsyncClient,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    (run_id,) = await trigger(h, [{"p": "q" * 2000}], ["skip"])
    some = values(await client.get("/realtime/v1/runs", params={"tags": "skip", "offset": "-1",
                                                                 "skipColumns": "payload,number,id"}))[run_id]
    assert "payload" not in some and "number" not in some and "payloadType" in some
    assert some["id"] == run_id and some["status"] == "PENDING"  # what names a run cannot be skipped

    async def unread(*_: Any, **__: Any) -> None:
        raise AssertionError("packets read although every packet column was skipped")

    monkeypatch.setattr(h.engine, "run_packets", unread)
    none = values(await client.get(f"/realtime/v1/runs/{run_id}", params={
        "offset": "-1", "skipColumns": "payload,output,metadata,error"}))[run_id]
    assert not {"payload", "output", "metadata", "error"} & set(none) and none["taskIdentifier"] == "hello"
    bad = await client.get("/realtime/v1/runs", params={"tags": "skip", "offset": "-1", "skipColumns": "x," * 41})
    assert bad.status_code == 400


def plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [plan, *(n for child in plan.get("Plans", []) for n in plan_nodes(child))]


async def test_sizes_are_measured_only_until_the_budget_is_spent(h: Harness) -> None:
    """Thirty runs whose 20 kB payloads compress to a few hundred bytes: each one measured means
    turning it into text; measuring stops once four times the answer's inline budget was measured
    (the runs are all in the answer still, their payloads by reference)."""
    ids = await trigger(h, ["c" * 20_000 for _ in range(30)], ["walk"])
    params = {"ids": ids, "env": h.env.env_id, "item": 1000, "budget": 10_000, "work": 40_000,
              "answer": 100_000, "chars": SHAPE_ERROR_CHARS, "payload": True, "output": True, "metadata": True,
              "error": True}
    async with h.engine.resources.repo.pool.connection() as conn:
        rows = await (await conn.execute(_RUN_PACKETS, params)).fetchall()
    assert [r[0] for r in rows] == ids and all(r[1] is None and r[2] for r in rows)  # every one by reference
    assert [r[-1] for r in rows] == [20_002, 40_004] + [40_004] * 28  # 40,004 > 40,000: no more measured


async def test_an_answer_ends_where_metadata_and_errors_fill_it_and_the_next_one_goes_on(
        h: Harness, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Metadata has no reference the SDK could fetch: fifty runs of 300 bytes of metadata each in
    answers of 2,000 bytes go six at a time, each answer without up-to-date and with an offset that
    names the last run sent, until the last one; every run sent once, in order of its change."""
    monkeypatch.setattr(shape_stream, "ANSWER_BYTES", 2000)
    ids = await trigger(h, [{"n": i} for i in range(50)], ["meta"])
    for run_id in ids:
        await h.engine.set_metadata(h.env.env_id, run_id, {"m": "x" * 290})
    offset, seen, answers = "-1", [], 0
    while True:
        answer = await client.get("/realtime/v1/runs", params={"tags": "meta", "offset": offset})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        sent = [m["value"] for m in body if "value" in m]
        assert sum(len(v["metadata"]) for v in sent) <= 2000 or len(sent) == 1
        assert all(orjson.loads(v["metadata"]) == {"m": "x" * 290} for v in sent)
        seen += [v["id"] for v in sent]
        answers += 1
        offset = answer.headers["electric-offset"]
        if body[-1] == shape_stream.UP_TO_DATE:
            break
        assert len(offset.split("_")) == 4 and sent[-1]["id"].endswith(offset.split("_")[2])
        assert answers < 20
    assert sorted(seen) == sorted(ids) and len(seen) == 50 and answers == 9
    changed = sorted(await h.engine.list_runs(h.env.env_id, tags=["meta"], limit=100, light=True),
                     key=lambda r: (r.updated_at, r.id))
    assert seen == [r.id for r in changed]
    # live from there: a run changes; it comes as an update (with the runs changed within a moment
    # before the offset, sent again in parts: a change may have committed late among them)
    await h.engine.set_metadata(h.env.env_id, ids[7], {"m": "y"})
    updates: dict[str, dict[str, Any]] = {}
    for _ in range(20):
        live = await client.get("/realtime/v1/runs", params={"tags": "meta", "offset": offset, "live": "true"})
        assert live.status_code == 200, live.text
        changes = [m for m in live.json() if "value" in m]
        assert all(m["headers"]["operation"] == "update" for m in changes)
        updates.update((m["value"]["id"], m["value"]) for m in changes)
        offset = live.headers["electric-offset"]
        if live.json()[-1] == shape_stream.UP_TO_DATE:
            break
    assert live.json()[-1] == shape_stream.UP_TO_DATE and "electric-up-to-date" in live.headers
    assert orjson.loads(updates[ids[7]]["metadata"]) == {"m": "y"}


async def test_metadata_left_out_is_not_counted_either(h: Harness, client: httpx.AsyncClient,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shape_stream, "ANSWER_BYTES", 2000)
    ids = await trigger(h, [{"n": i} for i in range(20)], ["lean"])
    for run_id in ids:
        await h.engine.set_metadata(h.env.env_id, run_id, {"m": "x" * 290})
    answer = await client.get("/realtime/v1/runs", params={"tags": "lean", "offset": "-1",
                                                            "skipColumns": "metadata"})
    body = answer.json()
    assert body[-1] == shape_stream.UP_TO_DATE and len(body) == 21  # all twenty in one answer
    assert all("metadata" not in m["value"] for m in body[:-1])


@pytest.mark.parametrize("offset", ["1_2_X_1", "1_2_~_3_~_1", "1_2_a_b", "1_2_" + "a" * 200 + "_1",
                                    "99999999999999999999_1", "1_2_abc\n_1", "x_1"])
async def test_an_offset_this_server_never_answered_with_is_refused(h: Harness, client: httpx.AsyncClient,
                                                                     offset: str) -> None:
    await trigger(h, [1], ["odd"])
    answer = await client.get("/realtime/v1/runs", params={"tags": "odd", "offset": offset})
    assert answer.status_code == 400 and "offset" in answer.json()["error"]["message"], answer.text


async def test_an_offset_of_another_version_of_the_server_has_the_client_start_over(
        h: Harness, client: httpx.AsyncClient) -> None:
    """As ElectricSQL answers an offset it cannot serve: 409 and must-refetch, upon which its
    client (and Trigger.dev's SDK) drops what it holds and starts again at -1 (a rolling upgrade)."""
    (run_id,) = await trigger(h, [1], ["versions"])
    for offset in ("1795802164612920_14389435765_~", "1_2_a_3_4", "1_2_a_3_4_5_6_7"):
        answer = await client.get("/realtime/v1/runs", params={"tags": "versions", "offset": offset, "live": "true"})
        assert answer.status_code == 409 and answer.json() == [shape_stream.MUST_REFETCH], answer.text
        assert answer.headers["electric-handle"].startswith("tags-")
    again = values(await client.get("/realtime/v1/runs", params={"tags": "versions", "offset": "-1"}))
    assert list(again) == [run_id]


async def test_a_run_shape_request_reads_no_payload(h: Harness, api: httpx.AsyncClient,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Who may read a run is decided by its id, task, tags and batch: a request of a shape client
    (one at least every 20 s, and one per change) never reads its megabytes of payload."""
    big = {"b": "x" * (2 * 1024 * 1024)}
    (run,) = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=big)])
    repo = h.engine.resources.repo.runs
    real = repo.get_run
    whole: list[str] = []

    async def spy(run_id: str, env_id: str | None = None, *, light: bool = False) -> Any:
        got = await real(run_id, env_id, light=light)
        if got is not None and got.payload is not None:
            whole.append(run_id)
        return got

    monkeypatch.setattr(repo, "get_run", spy)
    answer = await api.get(f"/realtime/v1/runs/{run.id}", params={"offset": "-1"})
    assert answer.status_code == 200 and len(answer.content) < 64 * 1024
    assert whole == []


async def test_a_tenant_whose_costly_reads_are_slow_waits_for_its_own_turns_only(h: Harness,
                                                                                 api: httpx.AsyncClient) -> None:
    """Shape reads of one environment take at most two of the database pool's connections at
    once: its further requests wait for those, while another environment's are answered."""
    import asyncio

    ctx = api._transport.app.state.ctx  # type: ignore[attr-defined]
    await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=1, tags=("t",))])
    other = await ensure_environment(h.engine.resources.repo, secret="test-secret", org="other-org", project="p",
                                     env="dev")
    await h.engine.trigger_many([TriggerRequest(env_id=other.env_id, task_id="hello", payload=1, tags=("t",))])
    slow = asyncio.Event()
    held = asyncio.Event()
    holders = 0

    async def hold() -> None:  # this environment's reads in flight (a million runs of one tag)
        nonlocal holders
        async with ctx.costly_reads.turn(h.env.env_id):
            holders += 1
            if holders == 2:
                held.set()
            await slow.wait()

    hogs = [asyncio.create_task(hold()) for _ in range(2)]
    await asyncio.wait_for(held.wait(), 10)
    mine = asyncio.create_task(api.get("/realtime/v1/runs", params={"tags": "t", "offset": "-1"}))
    deadline = asyncio.get_running_loop().time() + 10
    while ctx.costly_reads.waiting_or_reading(h.env.env_id) < 3:  # its read waits for a turn
        assert asyncio.get_running_loop().time() < deadline and not mine.done()
        await asyncio.sleep(0.01)
    theirs = await asyncio.wait_for(api.get("/realtime/v1/runs", params={"tags": "t", "offset": "-1"},
                                            headers={"Authorization": f"Bearer {other.api_key}"}), 10)
    assert theirs.status_code == 200 and len(theirs.json()) >= 1
    assert not mine.done()
    slow.set()
    await asyncio.gather(*hogs)
    answer = await asyncio.wait_for(mine, 10)
    assert answer.status_code == 200 and len(answer.json()) >= 1


async def test_a_change_that_waited_for_a_run_is_dated_when_written(h: Harness) -> None:
    """A statement held up behind another that changes the same run (a long transaction of the
    engine, a bulk statement) writes the run's last change when it writes it, not when it began:
    later than any change a shape read may have sent before it committed, so within the 2 s window
    where late commits are looked for."""
    import asyncio

    (run,) = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=1)])
    repo = h.engine.resources.repo.runs
    async with repo.pool.connection() as holder:
        async with holder.transaction():
            await holder.execute("UPDATE task_run SET tags = tags WHERE id = %s", (run.id,))
            changed = asyncio.create_task(repo.set_metadata(run.id, {"late": True}))
            deadline = asyncio.get_running_loop().time() + 10
            while True:  # it waits for the run's row now
                cur = await holder.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                           "AND query LIKE 'UPDATE task_run SET metadata%%'")
                if (await cur.fetchone())[0]:  # type: ignore[index]
                    break
                assert asyncio.get_running_loop().time() < deadline and not changed.done()
                await asyncio.sleep(0.01)
            released = (await (await holder.execute("SELECT clock_timestamp()")).fetchone())[0]  # type: ignore[index]
        await changed
    after = await h.engine.get_run(run.id)
    assert after is not None and after.metadata == {"late": True} and after.updated_at >= released
