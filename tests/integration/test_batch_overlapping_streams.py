"""Two overlapping streams of one two-phase batch (a client retrying while its first stream is still
running): an index is never both a run and a failure of the batch, and makes one run."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from .conftest import Harness
from .test_batch_stream_errors import NDJSON, line, opened, stored


async def test_an_index_failed_by_one_stream_and_made_by_another_is_not_counted_failed(
        h: Harness, api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second stream read the batch's indexes before the first noted index 1 failed (a bad line),
    then made its run: the failure is dropped when the run is noted, so the batch (its parent waits
    on it) waits for that run. Before, the batch kept both (items_failed 1) and completed once index
    0's run finished, index 1's still queued (its waiting parent would resume before it)."""
    from run_engine.engine import TriggerRequest

    parent = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1)
    await h.engine.start_attempt(parent.id, d.snapshot.id)
    waited = {"parentRunId": parent.id, "resumeParentOnCompletion": True}
    batch_id = await opened(api, 2)
    read = h.engine.open_batch_items
    before = await read(h.env.env_id, batch_id)  # what the second stream read, before the first's note

    first = (await api.post(f"/api/v3/batches/{batch_id}/items", headers=NDJSON,
                            content=line(0, options=waited) + b"\n" + line(1, task="", options=waited))).json()
    assert first["sealed"] is True and [e["index"] for e in first["errors"]] == [1]
    assert (await stored(h, batch_id))[:2] == ("PENDING", 1)

    async def stale(*args: Any) -> Any:
        return before

    monkeypatch.setattr(h.engine, "open_batch_items", stale)
    second = (await api.post(f"/api/v3/batches/{batch_id}/items", headers=NDJSON,
                             content=line(0, options=waited) + b"\n" + line(1, options=waited))).json()
    monkeypatch.setattr(h.engine, "open_batch_items", read)
    assert (second["itemsAccepted"], second["itemsDeduplicated"], second["sealed"]) == (1, 1, True)
    assert await stored(h, batch_id) == ("PENDING", 0, 0, False)
    got = (await api.get(f"/api/v2/batches/{batch_id}")).json()
    assert len(got["runs"]) == 2 and got["processing"]["errors"] == []

    runs = {(await h.engine.get_run(r)).payload["i"]: r for r in got["runs"]}  # type: ignore[union-attr]
    dequeued = {d.run.id: d for d in await h.engine.dequeue(h.env.worker_group_id, 10)}
    for index in (0, 1):
        started = await h.engine.start_attempt(runs[index], dequeued[runs[index]].snapshot.id)
        await h.engine.complete_attempt(runs[index], started.snapshot.id, ok=True, output={})
        if index == 0:  # index 1's run has not finished: the batch waits
            assert await stored(h, batch_id) == ("PENDING", 0, 1, False)
    assert await stored(h, batch_id) == ("COMPLETED", 0, 2, True)


async def test_a_failure_noted_for_an_index_already_made_is_ignored(h: Harness, api: httpx.AsyncClient,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The other order: the second stream's run for index 1 was noted first; the first stream's bad
    line for it, read before, is not kept nor counted."""
    batch_id = await opened(api, 2)
    read = h.engine.open_batch_items
    before = await read(h.env.env_id, batch_id)
    made = (await api.post(f"/api/v3/batches/{batch_id}/items", headers=NDJSON,
                           content=line(0) + b"\n" + line(1))).json()
    assert made["sealed"] is True

    async def stale(*args: Any) -> Any:
        return before

    monkeypatch.setattr(h.engine, "open_batch_items", stale)
    failed = (await api.post(f"/api/v3/batches/{batch_id}/items", headers=NDJSON,
                             content=line(0) + b"\n" + line(1, task=""))).json()
    assert [e["index"] for e in failed["errors"]] == [1]
    assert await stored(h, batch_id) == ("PENDING", 0, 0, False)
    assert (await api.get(f"/api/v2/batches/{batch_id}")).json()["processing"]["errors"] == []


async def _died(*args: Any, **kwargs: Any) -> int:
    raise RuntimeError("the process died here")


@pytest.mark.parametrize("again", [{"task": "limited"}, {"options": {"idempotencyKey": "second"}}],
                         ids=["another task", "another key"])
async def test_an_index_made_by_a_stream_that_died_before_its_note_makes_no_second_run(
        h: Harness, api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, again: dict[str, Any]) -> None:
    """The first stream made index 0's run (task hello) and died before noting it; its retry sends
    index 0 as another task, or with another key of its own: the batch's run at that index is found
    (task_run.batch_index), not made again. Before, the idempotency key `<batch>:<index>` is a key
    of its task only (and an item's own key has no index): a second run was made, the batch of
    runCount 2 ending with 3 runs, as a reviewer reproduced."""
    batch_id = await opened(api, 2)
    note = h.engine.note_batch_items
    monkeypatch.setattr(h.engine, "note_batch_items", _died)
    first = line(0, options={"idempotencyKey": "first"}) if "options" in again else line(0)
    with pytest.raises(RuntimeError, match="died"):
        await api.post(f"/api/v3/batches/{batch_id}/items", content=first, headers=NDJSON)
    monkeypatch.setattr(h.engine, "note_batch_items", note)
    retried = line(0, **again) + b"\n" + line(1)
    sent = (await api.post(f"/api/v3/batches/{batch_id}/items", content=retried, headers=NDJSON)).json()
    assert (sent["itemsAccepted"], sent["itemsDeduplicated"], sent["sealed"]) == (1, 1, True)
    got = (await api.get(f"/api/v2/batches/{batch_id}")).json()
    assert len(got["runs"]) == 2
    tasks = sorted([((run := await h.engine.get_run(r)) and (run.payload["i"], run.task_id)) for r in got["runs"]])
    assert tasks == [(0, "hello"), (1, "hello")]


async def test_a_failure_of_an_index_whose_run_is_not_noted_yet_is_not_kept(
        h: Harness, api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Overlapping streams again: the second made index 1's run and died before noting it; the first
    had read the batch before that run was made, and notes index 1 failed (a bad line). The failure
    is not kept: the index has its run. Before, items_failed counted it beside the run."""
    batch_id = await opened(api, 2)
    note = h.engine.note_batch_items
    monkeypatch.setattr(h.engine, "note_batch_items", _died)
    with pytest.raises(RuntimeError, match="died"):
        await api.post(f"/api/v3/batches/{batch_id}/items", content=line(1), headers=NDJSON)
    monkeypatch.setattr(h.engine, "note_batch_items", note)

    async def stale(*args: Any) -> set[int]:
        return set()  # as the first stream read it, before index 1's run

    monkeypatch.setattr(h.engine, "batch_indexes_run", stale, raising=False)
    sent = (await api.post(f"/api/v3/batches/{batch_id}/items", headers=NDJSON,
                           content=line(0) + b"\n" + line(1, task=""))).json()
    monkeypatch.delattr(h.engine, "batch_indexes_run")  # the engine's own again
    assert [e["index"] for e in sent["errors"]] == [1]
    assert await stored(h, batch_id) == ("PENDING", 0, 0, False)
    got = (await api.get(f"/api/v2/batches/{batch_id}")).json()
    assert len(got["runs"]) == 2 and got["processing"]["errors"] == []
