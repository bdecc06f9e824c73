"""Pages of whole runs are bounded in bytes (one tenant's list of hundred 3 MiB payloads must not
take the memory every tenant's requests share): fewer runs a page, the cursor going on, none lost
or repeated; listings that need no payload read none."""

from __future__ import annotations

import httpx
import pytest

from run_engine.db.runs import _RUN_BYTES, RunRepository, page_walk
from run_engine.engine import PAGE_BYTES, TriggerRequest

from .conftest import Harness


async def trigger(h: Harness, payloads: list[object]) -> list[str]:
    runs = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=p)
                                        for p in payloads])
    return [r.id for r in runs]


async def test_a_page_holds_runs_up_to_its_bytes_and_the_next_one_goes_on(h: Harness) -> None:
    ids = await trigger(h, ["x" * 1000 for _ in range(9)])
    await trigger(h, ["y" * 5000])  # alone over the budget: a page of it alone, never none
    # newest first (runs of one batch share their creation time: then by id)
    light = await h.engine.list_runs(h.env.env_id, limit=25, light=True)
    newest_first = [r.id for r in light]
    assert len(newest_first) == 10 and set(ids) < set(newest_first) and {r.payload for r in light} == {None}
    seen, after, sizes = [], None, []
    while True:
        runs, more = await h.engine.page_runs(h.env.env_id, limit=25, max_bytes=2500, after=after)
        assert runs and all(r.payload is not None for r in runs)
        seen += [r.id for r in runs]
        sizes.append(len(runs))
        if not more:
            break
        after = (runs[-1].created_at, runs[-1].id)
    assert seen == newest_first  # every run once, in order
    assert sizes == [1, 2, 2, 2, 2, 1]


@pytest.fixture
def client(api: httpx.AsyncClient) -> httpx.AsyncClient:
    return api


async def test_the_public_list_pages_large_payloads_by_bytes(h: Harness, client: httpx.AsyncClient) -> None:
    each = int(PAGE_BYTES * 0.18)  # five fit in a page, six do not
    await trigger(h, ["z" * each for _ in range(6)])
    ids = [r.id for r in await h.engine.list_runs(h.env.env_id, limit=25, light=True)]  # newest first
    first = (await client.get("/api/v1/runs", params={"page[size]": "25"})).json()
    assert [r["id"] for r in first["data"]] == ids[:5]
    assert all(len(r["payload"]) == each for r in first["data"])
    second = (await client.get("/api/v1/runs", params={"page[size]": "25",
                                                       "page[after]": first["pagination"]["next"]})).json()
    assert [r["id"] for r in second["data"]] == ids[5:] and second["pagination"] == {}


async def test_tokens_are_paged_by_their_outputs_bytes(h: Harness) -> None:
    made = [(await h.engine.create_token(h.env.env_id))[0] for _ in range(5)]
    for wp in made:
        assert await h.engine.complete_waitpoint(wp.id, "o" * 1000, env_id=h.env.env_id)
    repo = h.engine.resources.repo.waitpoints
    seen, after, sizes = [], None, []
    while True:
        page, more = await repo.list_tokens(h.env.env_id, limit=25, after=after, max_bytes=2500)
        assert all(w.output == "o" * 1000 for w in page)
        seen += [w.id for w in page]
        sizes.append(len(page))
        if not more:
            break
        after = (page[-1].created_at, page[-1].id)
    assert sorted(seen) == sorted(w.id for w in made) and len(seen) == 5 and sizes == [2, 2, 1]


async def test_dead_letter_pages_end_past_their_bytes(make_engine, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    import systems.dead_letter

    h: Harness = await make_engine(max_deliveries=1)
    await h.deploy({"id": "hello"})
    ids = await trigger(h, ["p" * 1000 for _ in range(5)])
    assert len(await h.engine.dequeue(h.env.worker_group_id, 5)) == 5
    await h.advance(61)  # never started: past the delivery limit, into the DLQ
    monkeypatch.setattr(systems.dead_letter, "PAGE_BYTES", 2500)
    seen, after, sizes = [], None, []
    while True:
        dead, after = await h.engine.list_dead(h.env.env_id, 25, after)
        seen += [d.run.id for d in dead]
        sizes.append(len(dead))
        if after is None:
            break
    assert sorted(seen) == sorted(ids) and sizes == [3, 2]  # a page ends once past its bytes


async def dead_letter(h: Harness, task: str, count: int) -> list[str]:
    """``count`` runs of ``task`` in the DLQ (each dequeued once and never started), oldest first."""
    ids = [r.id for r in await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id=task)
                                                        for _ in range(count)])]
    assert len(await h.engine.dequeue(h.env.worker_group_id, count)) == count
    await h.advance(61)
    return ids


async def test_a_dead_letter_page_walks_a_bounded_number_of_entries(make_engine,  # type: ignore[no-untyped-def]
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A filter that matches none of a long DLQ must not walk all of it in one request: a page ends
    after WALK entries (empty if need be) with a cursor that goes on from there, none lost."""
    import systems.dead_letter

    h: Harness = await make_engine(max_deliveries=1)
    await h.deploy({"id": "common"}, {"id": "rare"})
    await dead_letter(h, "common", 45)
    h.clock.advance(1)
    rare = await dead_letter(h, "rare", 3)
    monkeypatch.setattr(systems.dead_letter.DeadLetterSystem, "PAGE", 10)
    monkeypatch.setattr(systems.dead_letter.DeadLetterSystem, "WALK", 20)
    walked: list[int] = []
    list_dlq = h.engine.resources.queue.list_dlq

    async def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        entries = await list_dlq(*args, **kwargs)
        walked[-1] += len(entries)
        return entries

    monkeypatch.setattr(h.engine.resources.queue, "list_dlq", counting)
    pages, after = [], None
    while True:
        walked.append(0)
        dead, after = await h.engine.list_dead(h.env.env_id, 25, after, tasks={"rare"})
        pages.append([d.run.id for d in dead])
        if after is None:
            break
    # 20 and 20 entries walked, then the last 5 common and the 3 rare (dead in one millisecond: by id)
    assert pages == [[], [], sorted(rare)]
    assert walked == [20, 20, 8]


async def test_a_dead_letter_cursor_goes_on_after_its_run_left_the_dlq(make_engine) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await make_engine(max_deliveries=1)
    await h.deploy({"id": "hello"})
    ids = await dead_letter(h, "hello", 4)
    in_order = [d.run.id for d in (await h.engine.list_dead(h.env.env_id, 25))[0]]
    assert sorted(in_order) == sorted(ids)
    first, after = await h.engine.list_dead(h.env.env_id, 2)
    assert [d.run.id for d in first] == in_order[:2] and after is not None
    await h.engine.redrive(h.env.env_id, in_order[1])  # the page's last run leaves the DLQ
    second, after = await h.engine.list_dead(h.env.env_id, 2, after)
    assert [d.run.id for d in second] == in_order[2:] and after is None  # not from the start again
    # a bare run id (a cursor of an engine before this one) is looked up in the DLQ
    again, _ = await h.engine.list_dead(h.env.env_id, 2, in_order[0])
    assert [d.run.id for d in again] == in_order[2:]


@pytest.mark.parametrize("cursor", ["x|run_1", "|run_1", "12|", "1" * 16 + "|run_1", "9" * 300])
async def test_a_dead_letter_cursor_not_of_this_api_is_refused(client: httpx.AsyncClient, cursor: str) -> None:
    r = await client.get("/api/v1/dlq", params={"page[after]": cursor})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_input", r.text


async def test_a_page_measures_its_candidates_only_until_it_is_full(h: Harness) -> None:
    """Every candidate turned into text to keep a few would cost PostgreSQL a hundred 3 MiB payloads
    per page: the sizes are added up a run at a time and stop one run past the budget."""
    await trigger(h, ["w" * 1000 for _ in range(30)])
    where, params = RunRepository._run_filter(h.env.env_id, (), (), (), (), (), None, None, None, None)
    async with h.engine.resources.repo.pool.connection() as conn:
        cur = await conn.execute(page_walk("task_run", where, _RUN_BYTES),
                                 {**params, "limit": 26, "max_bytes": 2500})
        walked = await cur.fetchall()
    assert [size for _, size, _ in walked] == [1002, 1002, 1002]  # two fit, the third passes: no more measured
    assert {count for _, _, count in walked} == {26}
    runs, more = await h.engine.page_runs(h.env.env_id, limit=25, max_bytes=2500)
    assert [r.id for r in runs] == [run_id for run_id, _, _ in walked[:2]] and more


async def test_given_runs_are_measured_in_order_until_one_past_the_budget(h: Harness) -> None:
    """The DLQ's slices: a run gone meanwhile measures as None and adds nothing; the runs after the
    one that passes the budget are not measured at all."""
    ids = await trigger(h, ["v" * 1000 for _ in range(5)])
    sizes = await h.engine.resources.repo.runs.run_sizes(h.env.env_id, [ids[0], "run_gone", *ids[1:]], 1500)
    assert sizes == {ids[0]: 1002, "run_gone": None, ids[1]: 1002}
