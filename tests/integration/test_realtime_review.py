"""From a review of realtime, run metadata and replay: a run's Server-Sent Events stream sends
every change of its run (API.md: "on every change"), its metadata and tags too; a replay starts
with the metadata its run was triggered with, not what the run made of it."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from run_engine.engine import Debounce, RunFilter, TriggerRequest

from .conftest import Harness, api_client
from .test_stream_credentials import streaming


def events(text: str) -> list[dict[str, Any]]:
    return [orjson.loads(line.removeprefix("data: ")) for line in text.splitlines() if line.startswith("data: ")]


async def until(check: Any, deadline_s: float = 10.0) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while loop.time() < end:
        if check():
            return True
        await asyncio.sleep(0.02)
    return False


def count_full_reads(h: Harness, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on, the ids of the runs the engine reads whole (not light), in order: a stream's
    events each read their run so."""
    full_reads: list[str] = []
    get_run = h.engine.get_run

    async def counted(run_id: str, env_id: str | None = None, *, light: bool = False) -> Any:
        got = await get_run(run_id, env_id, light=light)
        if not light:
            full_reads.append(run_id)
        return got

    monkeypatch.setattr(h.engine, "get_run", counted)
    return full_reads

async def test_a_run_stream_sends_a_change_of_its_metadata_and_tags(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the stream woke on a metadata or tags change but sent an event only when the status
    changed: a client following a run's progress (metadata) saw none of it until the run ended."""
    full_reads = count_full_reads(h, monkeypatch)
    async with streaming(h, monkeypatch) as (run_id, answer):
        assert await until(lambda: len(full_reads) == 1)  # the first event's read
        await h.engine.set_metadata(h.env.env_id, run_id, {"progress": 50})
        await until(lambda: len(full_reads) == 2)  # the change's event (none before the fix)
        await h.engine.add_tags(h.env.env_id, run_id, ["seen"], 10)
        await until(lambda: len(full_reads) == 3)
        await asyncio.sleep(0.3)  # rechecks every 0.05 s meanwhile: nothing changed, nothing read whole
        assert len(full_reads) == 3
        await h.engine.cancel(run_id)
        got = await asyncio.wait_for(answer, 20)
    sent = events(got.text)
    assert [(e["status"], e["metadata"], e["tags"]) for e in sent] == [
        ("DELAYED", {}, []), ("DELAYED", {"progress": 50}, []), ("DELAYED", {"progress": 50}, ["seen"]),
        ("CANCELED", {"progress": 50}, ["seen"])]


async def test_a_replay_starts_with_the_metadata_its_run_was_triggered_with(h: Harness) -> None:
    """Metadata given at trigger is an option; what the run (or anyone) wrote since is its state.
    Before, a replay (one by id, or a bulk action's) copied the metadata as the old run left it:
    the new run began with the old one's final progress ({"step": "done", "progress": 100})."""
    seeded = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=1,
                                                   tags=("rp",), metadata={"step": "start"}))
    bare = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=2, tags=("rp",)))
    untouched = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=3,
                                                      tags=("rp",), metadata={"kept": True}))
    async with api_client(h) as api:
        for run in (seeded, bare):
            for update in ({"step": "half", "progress": 50}, {"step": "done", "progress": 100}):
                answer = await api.put(f"/api/v1/runs/{run.id}/metadata", json={"metadata": update})
                assert answer.status_code == 200, answer.text
        replayed = {}
        for run in (seeded, bare, untouched):
            answer = await api.post(f"/api/v1/runs/{run.id}/replay")
            assert answer.status_code == 200, answer.text
            replayed[run.id] = (await api.get(f"/api/v3/runs/{answer.json()['id']}")).json()["metadata"]
    assert replayed == {seeded.id: {"step": "start"}, bare.id: {}, untouched.id: {"kept": True}}
    assert (await h.engine.get_run(seeded.id)).metadata == {"step": "done", "progress": 100}  # type: ignore[union-attr]

    action, _ = await h.engine.create_bulk_action(h.env.env_id, "REPLAY", RunFilter(ids=(seeded.id, bare.id)))
    while await h.engine.systems.bulk_actions.run_page(action.id):
        pass
    made = [r for r in await h.engine.list_runs(h.env.env_id, tags=["rp"], limit=100)
            if r.idempotency_key is not None and r.idempotency_key.startswith(action.id)]
    assert {r.idempotency_key: r.metadata for r in made} == {f"{action.id}:{seeded.id}": {"step": "start"},
                                                             f"{action.id}:{bare.id}": None}


async def test_a_trailing_debounce_gives_its_run_a_new_seed(h: Harness) -> None:
    """A trailing debounced trigger's metadata is a trigger's: a replay starts with it, even when
    the run's metadata was replaced before that trigger joined it; one that gives none keeps the seed."""
    key = "seed-key"

    def debounced(**kw: Any) -> TriggerRequest:
        return TriggerRequest(env_id=h.env.env_id, task_id="hello", debounce=Debounce(key, 10, "trailing", None), **kw)

    run = await h.engine.trigger(debounced(payload=1, metadata={"seed": 1}))
    await h.engine.set_metadata(h.env.env_id, run.id, {"progress": 1})
    await h.engine.trigger(debounced(payload=2, metadata={"seed": 2}))
    await h.engine.set_metadata(h.env.env_id, run.id, {"progress": 2})
    await h.engine.trigger(debounced(payload=3))  # no metadata: the seed stays
    assert (await h.engine.get_run(run.id)).metadata == {"progress": 2}  # type: ignore[union-attr]
    replay = await h.engine.replay(await h.engine.get_run(run.id))  # type: ignore[arg-type]
    assert (await h.engine.get_run(replay.id)).metadata == {"seed": 2}  # type: ignore[union-attr]
