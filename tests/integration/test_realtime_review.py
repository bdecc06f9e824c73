"""From a review of realtime, run metadata and replay: a run's Server-Sent Events stream sends
every change of its run (API.md: "on every change"), its metadata and tags too; a replay starts
with the metadata its run was triggered with, not what the run made of it."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from .conftest import Harness
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


async def test_a_run_stream_sends_a_change_of_its_metadata_and_tags(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the stream woke on a metadata or tags change but sent an event only when the status
    changed: a client following a run's progress (metadata) saw none of it until the run ended."""
    full_reads: list[str] = []
    get_run = h.engine.get_run

    async def counted(run_id: str, env_id: str | None = None, *, light: bool = False) -> Any:
        got = await get_run(run_id, env_id, light=light)
        if not light:
            full_reads.append(run_id)
        return got

    monkeypatch.setattr(h.engine, "get_run", counted)
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
