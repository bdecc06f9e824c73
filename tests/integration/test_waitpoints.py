"""Waitpoints, blocking, suspension and restore by replay (DESIGN §7), on real PostgreSQL and Redis
with a fake clock."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest

from run_engine.engine import TriggerRequest
from run_engine.errors import DuplicateExecutionError, InvalidTransitionError, NotFoundError, StaleSnapshotError
from run_engine.statuses import RunStatus

from .conftest import Harness

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


def fail_once(monkeypatch: pytest.MonkeyPatch, target: object, name: str) -> None:
    """``target.name`` raises ConnectionError once (PostgreSQL going away mid-call), then is itself again."""
    real = getattr(target, name)

    async def fails_once(*args: object, **kwargs: object) -> object:
        monkeypatch.setattr(target, name, real)
        raise ConnectionError("PostgreSQL went away")

    monkeypatch.setattr(target, name, fails_once)


def req(h: Harness, task: str = "hello", **kw: object) -> TriggerRequest:
    return TriggerRequest(env_id=h.env.env_id, task_id=task, **kw)  # type: ignore[arg-type]


async def started_run(h: Harness, task: str = "hello"):  # type: ignore[no-untyped-def]
    run = await h.engine.trigger(req(h, task))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1)
    return run, await h.engine.start_attempt(run.id, d.snapshot.id)


def count_items(monkeypatch, obj: object, name: str) -> list[int]:  # type: ignore[no-untyped-def]
    """Wrap ``obj.name`` (a method taking one sequence): the length of each call's sequence."""
    sizes: list[int] = []
    method = getattr(obj, name)

    async def counted(items):  # type: ignore[no-untyped-def]
        sizes.append(len(items))
        return await method(items)

    monkeypatch.setattr(obj, name, counted)
    return sizes


async def restore(h: Harness, run_id: str):  # type: ignore[no-untyped-def]
    got = await h.engine.dequeue(h.env.worker_group_id, 10)
    (d,) = [g for g in got if g.run.id == run_id]
    assert d.snapshot.engine_status == "PENDING_EXECUTING" and d.snapshot.checkpoint_id is not None
    return await h.engine.start_attempt(run_id, d.snapshot.id)


async def test_token_wait_suspends_releases_the_slot_and_resumes_by_replay(h: Harness) -> None:
    run, s = await started_run(h)
    token, cached = await h.engine.waitpoints.create_token(h.env.env_id, timeout_s=3600)
    assert not cached
    out = await h.engine.block(run.id, s.snapshot.id, sequence=0, kind="token", key=token.id,
                               waitpoint_ids=[token.id])
    assert out.blocked and out.snapshot.engine_status == "EXECUTING_WITH_WAITPOINTS"
    assert (await h.engine.get_run(run.id)).status == "WAITING"  # type: ignore[union-attr]
    suspended = await h.engine.suspend(run.id, out.snapshot.id)
    assert suspended.engine_status == "SUSPENDED" and suspended.checkpoint_id
    assert await h.engine.resources.queue.running_ids(h.env.env_id) == set()  # no slot held
    assert await h.engine.waitpoints.complete(token.id, {"approved": True})
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "QUEUED_EXECUTING"
    resumed = await restore(h, run.id)
    assert resumed.attempt_number == 1 and resumed.snapshot.attempt_number == 1  # same attempt, not a retry
    journal = (await h.engine.waitpoints.resolved_journal(run.id)).entries
    assert journal == [{"sequence": 0, "kind": "token", "key": token.id, "resolved": True,
                        "result": {"ok": True, "output": {"approved": True}}}]
    done = await h.engine.complete_attempt(run.id, resumed.snapshot.id, ok=True, output=1)
    assert done.status == RunStatus.COMPLETED
    assert await h.statuses(run.id) == [
        "QUEUED", "PENDING_EXECUTING", "EXECUTING", "EXECUTING_WITH_WAITPOINTS", "SUSPENDED",
        "QUEUED_EXECUTING", "PENDING_EXECUTING", "EXECUTING", "FINISHED"]
    assert h.names(run.id).count("run_continued") == 1


async def test_completion_while_still_in_the_executor_continues_in_place(h: Harness) -> None:
    run, s = await started_run(h)
    token, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    out = await h.engine.block(run.id, s.snapshot.id, sequence=0, kind="token", key=token.id, waitpoint_ids=[token.id])
    await h.engine.waitpoints.complete(token.id, "yes")
    latest = await h.engine.latest_snapshot(run.id)
    assert latest.engine_status == "EXECUTING" and latest.completed_waitpoint_ids == [token.id]
    # the checkpoint of the snapshot that moved on is refused
    with pytest.raises(StaleSnapshotError):
        await h.engine.suspend(run.id, out.snapshot.id)
    assert await h.engine.resources.queue.running_ids(h.env.env_id) == {run.id}  # kept its slot


async def test_already_completed_token_does_not_block(h: Harness) -> None:
    run, s = await started_run(h)
    token, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    assert await h.engine.waitpoints.complete(token.id, 1)
    assert not await h.engine.waitpoints.complete(token.id, 2)  # first completion wins
    out = await h.engine.block(run.id, s.snapshot.id, sequence=0, kind="token", key=token.id, waitpoint_ids=[token.id])
    assert not out.blocked and out.snapshot.id == s.snapshot.id
    assert out.entry is not None and out.entry["result"] == {"ok": True, "output": 1}


async def test_datetime_wait_completes_by_engine_job(h: Harness) -> None:
    run, s = await started_run(h)
    wp = await h.engine.waitpoints.create_datetime(h.env.env_id, datetime.fromtimestamp(h.clock.now() + 10, UTC))
    out = await h.engine.block(run.id, s.snapshot.id, sequence=0, kind="wait", key=wp.id, waitpoint_ids=[wp.id])
    await h.engine.suspend(run.id, out.snapshot.id)
    await h.advance(9)
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "SUSPENDED"
    await h.advance(1.5)
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "QUEUED_EXECUTING"


async def test_token_timeout_gives_an_error_the_task_can_inspect(h: Harness) -> None:
    run, s = await started_run(h)
    token, _ = await h.engine.waitpoints.create_token(h.env.env_id, timeout_s=5)
    await h.engine.block(run.id, s.snapshot.id, sequence=0, kind="token", key=token.id, waitpoint_ids=[token.id])
    await h.advance(6)
    (entry,) = (await h.engine.waitpoints.resolved_journal(run.id)).entries
    assert entry["result"]["ok"] is False and entry["result"]["error"]["type"] == "WAITPOINT_TIMEOUT"
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "EXECUTING"
    # a completion after the timeout changes nothing
    assert not await h.engine.waitpoints.complete(token.id, "late")


async def test_idempotency_key_returns_the_same_token_until_its_ttl(h: Harness) -> None:
    a, cached_a = await h.engine.waitpoints.create_token(h.env.env_id, idempotency_key="k", idempotency_key_ttl_s=60)
    b, cached_b = await h.engine.waitpoints.create_token(h.env.env_id, idempotency_key="k", idempotency_key_ttl_s=60)
    assert a.id == b.id and not cached_a and cached_b
    h.clock.advance(61)
    c, cached_c = await h.engine.waitpoints.create_token(h.env.env_id, idempotency_key="k", idempotency_key_ttl_s=60)
    assert c.id != a.id and not cached_c


async def test_journal_insert_race_stops_a_duplicate_execution(h: Harness) -> None:
    run, s = await started_run(h)
    await h.engine.waitpoints.append_journal(run.id, s.snapshot.id, 0, "step", "load", [1, 2])
    with pytest.raises(DuplicateExecutionError):
        await h.engine.waitpoints.append_journal(run.id, s.snapshot.id, 0, "step", "load", [1, 2])


async def test_trigger_and_wait_resumes_the_parent_with_a_failed_child(h: Harness) -> None:
    parent, s = await started_run(h)
    (child_id,), out = await h.engine.trigger_and_wait(parent.id, s.snapshot.id, 0,
                                                       [req(h, max_attempts=1, payload={"x": 1})])
    assert out.blocked
    child = await h.engine.get_run(child_id)
    assert child is not None and child.parent_run_id == parent.id and child.depth == 1
    assert child.trigger_function == "triggerAndWait"
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)
    cs = await h.engine.start_attempt(child_id, d.snapshot.id)
    await h.engine.complete_attempt(child_id, cs.snapshot.id, ok=False, error={"type": "E", "message": "bad"})
    assert (await h.engine.latest_snapshot(parent.id)).engine_status == "EXECUTING"
    (entry,) = (await h.engine.waitpoints.resolved_journal(parent.id)).entries
    assert entry["result"] == {"ok": False, "id": child_id, "error": {"type": "E", "message": "bad"}}
    # a replay of the same call re-blocks on the same child instead of creating another
    latest = await h.engine.latest_snapshot(parent.id)
    again, out2 = await h.engine.trigger_and_wait(parent.id, latest.id, 0, [req(h)])
    assert again == [child_id] and not out2.blocked


async def test_batch_trigger_and_wait_gives_results_in_item_order(h: Harness) -> None:
    parent, s = await started_run(h)
    ids, out = await h.engine.trigger_and_wait(parent.id, s.snapshot.id, 0,
                                               [req(h, payload=i, max_attempts=1) for i in range(3)], batch=True)
    assert out.blocked and len(ids) == 3
    await h.engine.suspend(parent.id, out.snapshot.id)
    got = await h.engine.dequeue(h.env.worker_group_id, 10)
    for d in reversed(got):  # finish out of order
        st = await h.engine.start_attempt(d.run.id, d.snapshot.id)
        ok = d.run.payload != 1
        await h.engine.complete_attempt(d.run.id, st.snapshot.id, ok=ok, output=d.run.payload * 10,
                                        error=None if ok else {"type": "E", "message": "odd"})
    assert (await h.engine.latest_snapshot(parent.id)).engine_status == "QUEUED_EXECUTING"
    await restore(h, parent.id)
    (entry,) = (await h.engine.waitpoints.resolved_journal(parent.id)).entries
    assert entry["result"] == [
        {"ok": True, "id": ids[0], "output": 0},
        {"ok": False, "id": ids[1], "error": {"type": "E", "message": "odd"}},
        {"ok": True, "id": ids[2], "output": 20},
    ]


async def test_cancel_cascades_to_children_and_the_parent_never_resumes(h: Harness) -> None:
    parent, s = await started_run(h)
    ids, out = await h.engine.trigger_and_wait(parent.id, s.snapshot.id, 0, [req(h), req(h)], batch=True)
    await h.engine.suspend(parent.id, out.snapshot.id)
    assert await h.engine.cancel(parent.id) == RunStatus.CANCELED
    for child in ids:
        assert (await h.engine.get_run(child)).status == "CANCELED"  # type: ignore[union-attr]
    assert (await h.engine.latest_snapshot(parent.id)).engine_status == "FINISHED"
    assert await h.engine.dequeue(h.env.worker_group_id, 10) == []


async def test_sweeper_fails_a_batch_whose_runs_were_never_created(h: Harness, unique: str) -> None:
    from run_engine.db.waitpoints import NewWaitpoint

    parent, s = await started_run(h)
    wp_repo = h.engine.resources.repo.waitpoints
    await h.engine.resources.repo.waitpoints.insert_batch(f"batch_broken_{unique}", h.env.env_id, 5, parent.id)
    wp, _ = await wp_repo.create(NewWaitpoint(id=f"waitpoint_broken_{unique}", env_id=h.env.env_id, type="BATCH",
                                              completed_by_batch_id=f"batch_broken_{unique}"))
    out = await h.engine.block(parent.id, s.snapshot.id, sequence=0, kind="batch", key=f"batch_broken_{unique}",
                               waitpoint_ids=[wp.id], result={"runIds": ["run_never_1", "run_never_2"]})
    assert out.blocked
    # (the database is shared with the other tests of the run: what a sweep counts may be theirs too)
    await h.engine.waitpoints.sweep(grace_s=3600)  # within the grace period
    assert (await wp_repo.get(wp.id)).status == "PENDING"  # type: ignore[union-attr]
    assert (await h.engine.waitpoints.sweep(grace_s=0))[0]["completed"] >= 1
    assert (await wp_repo.get(wp.id)).status == "COMPLETED"  # type: ignore[union-attr]
    assert (await h.engine.latest_snapshot(parent.id)).engine_status == "EXECUTING"
    (entry,) = (await h.engine.waitpoints.resolved_journal(parent.id)).entries
    assert [r["ok"] for r in entry["result"]] == [False, False]


async def test_waiting_run_whose_worker_died_is_suspended_not_failed(make_engine) -> None:  # type: ignore[no-untyped-def]
    h = await make_engine(executing_with_waitpoints_timeout_s=30)
    await h.deploy({"id": "hello"})
    run, s = await started_run(h)
    token, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    await h.engine.block(run.id, s.snapshot.id, sequence=0, kind="token", key=token.id, waitpoint_ids=[token.id])
    await h.advance(31)
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "SUSPENDED"
    await h.engine.waitpoints.complete(token.id, "ok")
    resumed = await restore(h, run.id)
    assert resumed.attempt_number == 1


async def test_suspended_run_frees_its_queue_for_the_next(h: Harness) -> None:
    a, sa = await started_run(h, "limited")
    b = await h.engine.trigger(req(h, "limited"))
    assert await h.engine.dequeue(h.env.worker_group_id, 5) == []  # limit 1: A holds it
    token, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    out = await h.engine.block(a.id, sa.snapshot.id, sequence=0, kind="token", key=token.id, waitpoint_ids=[token.id])
    await h.engine.suspend(a.id, out.snapshot.id)
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)
    assert d.run.id == b.id


async def test_a_resumed_run_keeps_its_place_in_the_queue(h: Harness) -> None:
    older, s = await started_run(h, "limited")
    token, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    out = await h.engine.block(older.id, s.snapshot.id, sequence=0, kind="token", key=token.id,
                               waitpoint_ids=[token.id])
    await h.engine.suspend(older.id, out.snapshot.id)
    h.clock.advance(1)
    newer = [await h.engine.trigger(req(h, "limited")) for _ in range(3)]
    await h.engine.waitpoints.complete(token.id, "go")  # queued again, behind nothing newer
    (first,) = await h.engine.dequeue(h.env.worker_group_id, 5)  # limit 1
    assert first.run.id == older.id and first.run.id not in {n.id for n in newer}


async def test_a_child_that_is_refused_fails_the_wait_instead_of_hanging(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 11: the journal entry was written, the child's creation failed, and every replay
    blocked the parent on a waitpoint of a run that never existed. A refused child (an error
    another try would meet again) now fails the wait."""
    from run_engine.errors import QueueFullError

    parent, s = await started_run(h)

    async def refused(*args: object, **kwargs: object) -> None:
        raise QueueFullError(h.env.env_id, 10, 1, 10)

    monkeypatch.setattr(h.engine.systems.enqueue, "trigger_many", refused)
    with pytest.raises(QueueFullError):
        await h.engine.trigger_and_wait(parent.id, s.snapshot.id, 0, [req(h)])
    monkeypatch.undo()
    latest = await h.engine.latest_snapshot(parent.id)
    _, again = await h.engine.trigger_and_wait(parent.id, latest.id, 0, [req(h)])  # the retry's replay
    assert not again.blocked
    assert again.entry is not None and again.entry["result"]["ok"] is False
    assert again.entry["result"]["error"]["type"] == "CHILD_TRIGGER_FAILED"


@pytest.mark.parametrize(("batch", "failure"), [(False, "postgres"), (True, "postgres"), (False, "connection")])
async def test_children_not_created_during_an_outage_are_created_by_the_repeated_call(
        h: Harness, monkeypatch: pytest.MonkeyPatch, batch: bool, failure: str) -> None:
    """Found by bench/chaos.py: PostgreSQL away while a trigger-and-wait created its children
    failed the wait (the parent ended with a failed child). Now the call fails (503), the wait stays
    open, and the same call again (the supervisor repeats it; a replay makes it) creates the
    children still missing, with the ids the journal recorded."""
    import psycopg

    parent, s = await started_run(h)
    create = h.engine.systems.enqueue.trigger_many

    error = psycopg.OperationalError("server closed") if failure == "postgres" else ConnectionResetError("reset")

    async def away(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(h.engine.systems.enqueue, "trigger_many", away)
    items = [req(h, payload=i) for i in range(3 if batch else 1)]
    with pytest.raises(type(error)):
        await h.engine.trigger_and_wait(parent.id, s.snapshot.id, 0, items, batch=batch)
    monkeypatch.setattr(h.engine.systems.enqueue, "trigger_many", create)
    (entry,) = (await h.engine.journal(parent.id)).entries
    assert entry.waitpoint_status == "PENDING"  # not failed for an outage
    journaled = entry.result["runIds"]
    assert [await h.engine.get_run(rid) for rid in journaled] == [None] * len(items)
    ids, out = await h.engine.trigger_and_wait(parent.id, s.snapshot.id, 0, items, batch=batch)  # repeated
    assert ids == journaled and out.blocked
    for rid, item in zip(ids, items, strict=True):
        child = await h.engine.get_run(rid)
        assert child is not None and child.payload == item.payload and child.parent_run_id == parent.id
    await h.engine.suspend(parent.id, out.snapshot.id)
    for d in await h.engine.dequeue(h.env.worker_group_id, 10):
        st = await h.engine.start_attempt(d.run.id, d.snapshot.id)
        await h.engine.complete_attempt(d.run.id, st.snapshot.id, ok=True, output=d.run.payload)
    await restore(h, parent.id)
    (resolved,) = (await h.engine.resolved_journal(parent.id)).entries
    results = resolved["result"] if batch else [resolved["result"]]
    assert [r["ok"] for r in results] == [True] * len(items)
    assert [r["output"] for r in results] == [item.payload for item in items]


async def test_the_sweeper_fails_a_wait_on_a_child_that_was_never_created(h: Harness) -> None:
    from run_engine.db.waitpoints import JournalEntry, NewWaitpoint

    parent, s = await started_run(h)
    wp, _ = await h.engine.resources.repo.waitpoints.create(NewWaitpoint(
        id="waitpoint_orphan" + parent.id[-8:], env_id=h.env.env_id, type="RUN",
        completed_by_run_id="run_neverexisted"))
    # as a process that died between the parent's journal entry and the child's insert leaves it
    await h.engine.resources.repo.waitpoints.block(
        parent.id, [wp.id], JournalEntry(0, "child", "run_neverexisted", {"runIds": ["run_neverexisted"]}, wp.id))
    await h.engine.waitpoints.sweep(grace_s=0)
    got = await h.engine.resources.repo.waitpoints.get(wp.id)
    assert got is not None and got.status == "COMPLETED" and got.output_is_error


@pytest.mark.parametrize("finished", [True, False])
async def test_trigger_and_wait_with_a_taken_idempotency_key_waits_on_the_existing_run(
        h: Harness, finished: bool) -> None:
    """Issue 11: the waitpoint was made for a child id that never existed when the key returned
    another run, and the parent hung."""
    parent, s = await started_run(h)
    holder = await h.engine.trigger(req(h, payload="first", idempotency_key="once"))
    if finished:
        (d,) = await h.engine.dequeue(h.env.worker_group_id, 1)
        st = await h.engine.start_attempt(holder.id, d.snapshot.id)
        await h.engine.complete_attempt(holder.id, st.snapshot.id, ok=True, output={"done": 1})
    ids, out = await h.engine.trigger_and_wait(parent.id, s.snapshot.id, 0, [req(h, idempotency_key="once")])
    assert ids == [holder.id]
    if not finished:
        assert out.blocked
        got = await h.engine.dequeue(h.env.worker_group_id, 5)
        (d,) = [g for g in got if g.run.id == holder.id]
        st = await h.engine.start_attempt(holder.id, d.snapshot.id)
        await h.engine.complete_attempt(holder.id, st.snapshot.id, ok=True, output={"done": 1})
        await h.engine.waitpoints.sweep(grace_s=0)  # the holder was not triggered to wait: the sweeper completes
    (entry,) = (await h.engine.waitpoints.resolved_journal(parent.id)).entries
    assert entry["result"] == {"ok": True, "id": holder.id, "output": {"done": 1}}
    assert (await h.engine.latest_snapshot(parent.id)).engine_status == "EXECUTING"


async def _rows(h: Harness, run_id: str) -> tuple[int, int, int]:
    """(journal entries, blocking rows, checkpoints) of a run."""
    async with h.engine.resources.repo.pool.connection() as conn:
        cur = await conn.execute(
            """SELECT (SELECT count(*) FROM task_run_journal WHERE run_id = %(r)s),
                      (SELECT count(*) FROM task_run_waitpoint WHERE run_id = %(r)s),
                      (SELECT count(*) FROM task_run_checkpoint WHERE run_id = %(r)s)""", {"r": run_id})
        row = await cur.fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


async def test_a_block_or_suspend_refused_writes_nothing(h: Harness) -> None:
    run, s = await started_run(h)
    token, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    with pytest.raises(StaleSnapshotError):  # not the run's latest snapshot
        await h.engine.block(run.id, "snapshot_stale", sequence=0, kind="token", key=token.id,
                             waitpoint_ids=[token.id])
    with pytest.raises(InvalidTransitionError):  # an executing run is not suspended
        await h.engine.suspend(run.id, s.snapshot.id)
    assert await _rows(h, run.id) == (0, 0, 0)
    await h.engine.waitpoints.append_journal(run.id, s.snapshot.id, 0, "step", "load", 1)
    with pytest.raises(DuplicateExecutionError):  # another execution journaled sequence 0 differently
        await h.engine.block(run.id, s.snapshot.id, sequence=0, kind="token", key=token.id,
                             waitpoint_ids=[token.id])
    assert await _rows(h, run.id) == (1, 0, 0)
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "EXECUTING"
    with pytest.raises(NotFoundError):
        await h.engine.block("run_missing", s.snapshot.id, sequence=0, kind="token", key=token.id,
                             waitpoint_ids=[token.id])


async def test_a_replay_blocks_again_on_its_journaled_wait_and_suspend_writes_one_checkpoint(h: Harness) -> None:
    run, s = await started_run(h)
    token, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    await h.engine.waitpoints.append_journal(run.id, s.snapshot.id, 0, "step", "load", 1)
    out = await h.engine.block(run.id, s.snapshot.id, sequence=1, kind="token", key=token.id,
                               waitpoint_ids=[token.id])
    assert out.blocked and out.snapshot.description == f"Waiting (token {token.id})"
    suspended = await h.engine.suspend(run.id, out.snapshot.id)
    assert suspended.description == "Suspended: checkpoint at journal position 2"
    assert suspended.previous_snapshot_id == out.snapshot.id and suspended.attempt_number == 1
    assert await _rows(h, run.id) == (2, 1, 1)
    assert (await h.engine.get_run(run.id)).status == "WAITING"  # type: ignore[union-attr]
    with pytest.raises(StaleSnapshotError):  # a second suspend of the same snapshot
        await h.engine.suspend(run.id, out.snapshot.id)
    assert await _rows(h, run.id) == (2, 1, 1)
    # the token completes while the run is suspended; the restored run replays up to its wait
    assert await h.engine.waitpoints.complete(token.id, "go")
    resumed = await restore(h, run.id)
    again = await h.engine.block(run.id, resumed.snapshot.id, sequence=1, kind="token", key=token.id,
                                 waitpoint_ids=[token.id])
    assert not again.blocked and again.entry is not None and again.entry["result"] == {"ok": True, "output": "go"}
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "EXECUTING"


async def test_a_suspend_after_the_wait_completed_queues_the_run_to_restore(h: Harness) -> None:
    run, s = await started_run(h)
    token, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    out = await h.engine.block(run.id, s.snapshot.id, sequence=0, kind="token", key=token.id,
                               waitpoint_ids=[token.id])
    # completed behind the engine's back (as if its continue was lost): the suspend itself sees it
    async with h.engine.resources.repo.pool.connection() as conn:
        await conn.execute("UPDATE waitpoint SET status = 'COMPLETED', completed_at = now() WHERE id = %s",
                           (token.id,))
    snapshot = await h.engine.suspend(run.id, out.snapshot.id)
    assert snapshot.engine_status == "QUEUED_EXECUTING"
    assert (await h.statuses(run.id))[-2:] == ["SUSPENDED", "QUEUED_EXECUTING"]


async def test_a_run_continues_only_when_its_last_waitpoint_completes(h: Harness) -> None:
    run, s = await started_run(h)
    first, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    second, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    out = await h.engine.block(run.id, s.snapshot.id, sequence=0, kind="token", key=first.id,
                               waitpoint_ids=[first.id, second.id])
    assert out.blocked
    await h.engine.waitpoints.complete(first.id, 1)
    assert await h.engine.waitpoints.try_continue(run.id) is None  # one still pending: nothing written
    assert (await h.engine.latest_snapshot(run.id)).id == out.snapshot.id
    assert [w.id for w in await h.engine.blocking_waitpoints(run.id)] == [second.id]
    await h.engine.waitpoints.complete(second.id, 2)  # continues it
    latest = await h.engine.latest_snapshot(run.id)
    assert latest.engine_status == "EXECUTING" and latest.previous_snapshot_id == out.snapshot.id
    assert sorted(latest.completed_waitpoint_ids) == sorted([first.id, second.id])
    assert await h.engine.waitpoints.try_continue(run.id) is None  # idempotent: not blocked any more
    async with h.engine.resources.repo.pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) FROM task_run_waitpoint WHERE run_id = %s", (run.id,))
        assert await cur.fetchone() == (0,)


async def test_a_wait_that_asks_to_suspend_is_checkpointed_in_the_same_call(h: Harness) -> None:
    run, s = await started_run(h)
    token, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    out = await h.engine.block(run.id, s.snapshot.id, sequence=0, kind="token", key=token.id,
                               waitpoint_ids=[token.id], suspend=True)
    assert out.blocked and out.suspended and out.snapshot.engine_status == "SUSPENDED"
    assert out.snapshot.checkpoint_id and out.snapshot.description == "Suspended: checkpoint at journal position 1"
    assert await h.engine.resources.queue.running_ids(h.env.env_id) == set()  # its slot is free at once
    assert await h.statuses(run.id) == ["QUEUED", "PENDING_EXECUTING", "EXECUTING", "EXECUTING_WITH_WAITPOINTS",
                                        "SUSPENDED"]  # both snapshots kept
    assert h.names(run.id)[-2:] == ["run_blocked", "run_suspended"]
    assert await h.engine.waitpoints.complete(token.id, "go")
    resumed = await restore(h, run.id)
    again = await h.engine.block(run.id, resumed.snapshot.id, sequence=0, kind="token", key=token.id,
                                 waitpoint_ids=[token.id], suspend=True)  # the replay: nothing to wait for
    assert not again.blocked and not again.suspended and again.entry is not None
    assert again.entry["result"] == {"ok": True, "output": "go"}
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "EXECUTING"


async def test_a_run_restored_before_its_suspension_acked_it_keeps_its_message(h: Harness, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The suspension commits, then acks the run in the queue. A completion of its token in between
    (another request) continues the run and enqueues its restore; the ack must not delete that
    message, or the run would sit QUEUED with nothing in the queue until the reconciler."""
    run, s = await started_run(h)
    token, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    r = h.engine.resources
    ack_many = r.ack_many

    async def completed_first(items, *, held_only=False):  # type: ignore[no-untyped-def]
        assert await h.engine.waitpoints.complete(token.id, "go")  # the restore is enqueued now
        await ack_many(items, held_only=held_only)

    monkeypatch.setattr(r, "ack_many", completed_first)
    out = await h.engine.block(run.id, s.snapshot.id, sequence=0, kind="token", key=token.id,
                               waitpoint_ids=[token.id], suspend=True)
    assert out.suspended
    monkeypatch.setattr(r, "ack_many", ack_many)
    resumed = await restore(h, run.id)  # its message is there: handed out at once
    assert resumed.snapshot.engine_status == "EXECUTING"


async def test_a_wait_that_asks_to_suspend_on_a_completed_token_goes_on_in_its_executor(h: Harness) -> None:
    run, s = await started_run(h)
    token, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    await h.engine.waitpoints.complete(token.id, 7)
    out = await h.engine.block(run.id, s.snapshot.id, sequence=0, kind="token", key=token.id,
                               waitpoint_ids=[token.id], suspend=True)
    assert not out.blocked and not out.suspended and out.entry is not None
    assert out.entry["result"] == {"ok": True, "output": 7}
    assert await h.engine.resources.queue.running_ids(h.env.env_id) == {run.id}  # still running: slot kept
    assert await h.statuses(run.id) == ["QUEUED", "PENDING_EXECUTING", "EXECUTING"]


async def test_trigger_and_wait_that_asks_to_suspend_checkpoints_the_parent(h: Harness) -> None:
    parent, s = await started_run(h)
    run_ids, out = await h.engine.trigger_and_wait(parent.id, s.snapshot.id, 0, [req(h, payload={"x": 1})],
                                                suspend=True)
    assert out.blocked and out.suspended and out.snapshot.engine_status == "SUSPENDED"
    (child_run,) = run_ids
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)
    assert d.run.id == child_run
    child = await h.engine.start_attempt(child_run, d.snapshot.id)
    await h.engine.complete_attempt(child_run, child.snapshot.id, ok=True, output="c")
    resumed = await restore(h, parent.id)
    assert resumed.attempt_number == 1
    journal = (await h.engine.waitpoints.resolved_journal(parent.id)).entries
    assert journal[0]["resolved"] and journal[0]["result"] == {"ok": True, "id": child_run, "output": "c"}


async def test_a_completion_by_api_key_completes_only_a_token_of_its_own_environment(h: Harness, unique: str) -> None:
    from run_engine.tenancy import ensure_environment

    other = await ensure_environment(h.engine.resources.repo, secret="test-secret", org=f"org-other-{unique}",
                                     project="proj", env="dev")
    theirs, _ = await h.engine.waitpoints.create_token(other.env_id)
    ours, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    date = await h.engine.create_datetime_waitpoint(h.env.env_id, datetime(2100, 1, 1, tzinfo=UTC))
    assert not await h.engine.complete_waitpoint(theirs.id, "pwned", env_id=h.env.env_id)
    assert not await h.engine.complete_waitpoint(date.id, "early", env_id=h.env.env_id)  # not a token
    assert await h.engine.complete_waitpoint(ours.id, "ok", env_id=h.env.env_id)
    assert not await h.engine.complete_waitpoint(ours.id, "again", env_id=h.env.env_id)  # the first one wins
    for wp_id, status in ((theirs.id, "PENDING"), (date.id, "PENDING"), (ours.id, "COMPLETED")):
        wp = await h.engine.get_waitpoint(wp_id)
        assert wp is not None and wp.status == status
    assert (await h.engine.get_waitpoint(ours.id)).output == "ok"  # type: ignore[union-attr]


async def test_concurrent_blocks_share_one_statement_and_each_gets_its_own_outcome(h: Harness,
                                                                                   monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The waits of many runs arriving together are written by one block statement, which also
    suspends those asked to (one commit); a refused one (stale snapshot, a repeated request, a run
    that does not exist) fails alone, and every run ends as it would have on its own."""
    runs = [await started_run(h) for _ in range(5)]
    tokens = [(await h.engine.waitpoints.create_token(h.env.env_id))[0] for _ in runs]
    done_early, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    assert await h.engine.waitpoints.complete(done_early.id, "early")
    repo = h.engine.resources.repo.waitpoints
    sizes = {"block": count_items(monkeypatch, repo, "block_executing"),
             "suspend": count_items(monkeypatch, repo, "suspend")}
    locked: list[str] = []
    lock = h.engine.resources.locker.lock
    monkeypatch.setattr(h.engine.resources.locker, "lock", lambda name, *r: locked.append(name) or lock(name, *r))

    def block(i: int, snapshot_id: str | None = None, *, suspend: bool = False, token: str | None = None):  # type: ignore[no-untyped-def]
        run, s = runs[i]
        wp = token or tokens[i].id
        return h.engine.block(run.id, snapshot_id or s.snapshot.id, sequence=0, kind="token", key=wp,
                              waitpoint_ids=[wp], suspend=suspend)

    out = await asyncio.gather(
        block(0, suspend=True), block(1, suspend=True), block(2), block(3, "snapshot_stale"),
        block(4, token=done_early.id), block(0, suspend=True),  # run 0 asked twice (a repeated request)
        h.engine.block("run_missing", "snapshot_x", sequence=0, kind="token", key="k", waitpoint_ids=[tokens[0].id]),
        return_exceptions=True)
    assert sizes["block"][0] == 6 and sizes["suspend"] == []  # the five runs and the missing one together
    assert locked == []  # no run lock: each run's compare-and-set decides
    assert out[0].suspended and out[0].snapshot.engine_status == "SUSPENDED"  # type: ignore[union-attr]
    assert out[1].suspended and out[1].snapshot.engine_status == "SUSPENDED"  # type: ignore[union-attr]
    assert out[2].blocked and not out[2].suspended  # type: ignore[union-attr]
    assert out[2].snapshot.engine_status == "EXECUTING_WITH_WAITPOINTS"  # type: ignore[union-attr]
    assert isinstance(out[3], StaleSnapshotError)
    assert not out[4].blocked and out[4].entry["result"] == {"ok": True, "output": "early"}  # type: ignore[union-attr,index]
    assert isinstance(out[5], StaleSnapshotError)  # the repeat finds the run moved on by the first
    assert isinstance(out[6], NotFoundError)
    running = await h.engine.resources.queue.running_ids(h.env.env_id)
    assert runs[0][0].id not in running and runs[1][0].id not in running  # the suspended freed their slots
    assert {runs[2][0].id, runs[3][0].id, runs[4][0].id} <= running
    assert await h.statuses(runs[3][0].id) == ["QUEUED", "PENDING_EXECUTING", "EXECUTING"]
    assert await _rows(h, runs[3][0].id) == (0, 0, 0)
    assert await h.statuses(runs[0][0].id) == ["QUEUED", "PENDING_EXECUTING", "EXECUTING",
                                               "EXECUTING_WITH_WAITPOINTS", "SUSPENDED"]
    assert await _rows(h, runs[0][0].id) == (1, 1, 1)
    suspended = await h.engine.latest_snapshot(runs[0][0].id)
    assert suspended.description == "Suspended: checkpoint at journal position 1"
    async with h.engine.resources.repo.pool.connection() as conn:
        cur = await conn.execute("SELECT snapshot_id, journal_position FROM task_run_checkpoint WHERE id = %s",
                                 (suspended.checkpoint_id,))
        assert await cur.fetchone() == (suspended.previous_snapshot_id, 1)  # the checkpoint of the blocked snapshot
    # each completes and continues as usual: the suspended restored through the queue, the other in place
    for t in tokens[:3]:
        assert await h.engine.waitpoints.complete(t.id, t.id)
    assert [(await h.engine.latest_snapshot(r.id)).engine_status for r, _ in runs[:3]] == [
        "QUEUED_EXECUTING", "QUEUED_EXECUTING", "EXECUTING"]
    assert [h.names(r.id).count("run_blocked") for r, _ in runs] == [1, 1, 1, 0, 0]
    assert [h.names(r.id).count("run_suspended") for r, _ in runs] == [1, 1, 0, 0, 0]


async def test_concurrent_journal_and_waitpoint_reads_share_one_query(h: Harness, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    runs = [await started_run(h) for _ in range(3)]
    for n, (run, s) in enumerate(runs):
        for seq in range(n + 1):
            await h.engine.waitpoints.append_journal(run.id, s.snapshot.id, seq, "step", f"k{seq}", seq * 10)
    token, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    repo = h.engine.resources.repo.waitpoints
    asked = count_items(monkeypatch, repo, "journals")
    got = await asyncio.gather(*(h.engine.resolved_journal(run.id, n) for n, (run, _) in enumerate(runs)),
                               h.engine.resolved_journal("run_missing"))
    assert asked == [4]
    assert [[(e["sequence"], e["result"]) for e in page.entries] for page in got] == [
        [(0, 0)], [(1, 10)], [(2, 20)], []]
    asked = count_items(monkeypatch, repo, "get_many")
    found = await asyncio.gather(h.engine.get_waitpoint(token.id), h.engine.get_waitpoint(token.id, h.env.env_id),
                                 h.engine.get_waitpoint(token.id, "env_other"), h.engine.get_waitpoint("waitpoint_x"))
    assert asked == [4]
    assert [wp.id if wp else None for wp in found] == [token.id, token.id, None, None]


async def test_a_block_that_suspends_at_once_checkpoints_after_its_own_entry(h: Harness) -> None:
    run, s = await started_run(h)
    token, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    await h.engine.waitpoints.append_journal(run.id, s.snapshot.id, 0, "step", "load", 1)
    out = await h.engine.block(run.id, s.snapshot.id, sequence=1, kind="token", key=token.id,
                               waitpoint_ids=[token.id], suspend=True)
    assert out.suspended and out.snapshot.description == "Suspended: checkpoint at journal position 2"
    assert await h.statuses(run.id) == ["QUEUED", "PENDING_EXECUTING", "EXECUTING", "EXECUTING_WITH_WAITPOINTS",
                                        "SUSPENDED"]
    assert await _rows(h, run.id) == (2, 1, 1)
    assert await h.engine.resources.queue.running_ids(h.env.env_id) == set()
    assert await h.engine.waitpoints.complete(token.id, "go")
    resumed = await restore(h, run.id)
    assert resumed.attempt_number == 1
    again = await h.engine.block(run.id, resumed.snapshot.id, sequence=1, kind="token", key=token.id,
                                 waitpoint_ids=[token.id], suspend=True)
    assert not again.blocked and again.entry is not None and again.entry["result"] == {"ok": True, "output": "go"}


async def test_concurrent_tokens_without_a_key_share_one_insert_and_a_bad_one_fails_alone(
        h: Harness, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    sizes = count_items(monkeypatch, h.engine.resources.repo.waitpoints, "create_many")
    made = await asyncio.gather(
        *(h.engine.waitpoints.create_token(h.env.env_id, tags=[f"t{i}"], timeout_s=60) for i in range(5)),
        h.engine.waitpoints.create_token("env_missing"),  # no such environment: its insert fails
        h.engine.waitpoints.create_token(h.env.env_id, idempotency_key="kept"),  # a key: its own transaction
        return_exceptions=True)
    assert sizes[0] == 6  # the five and the bad one in one statement; then split to isolate the bad one
    assert isinstance(made[5], Exception)
    tokens = [m for m in made[:5] if not isinstance(m, BaseException)]
    assert [(t.tags, cached) for t, cached in tokens] == [([f"t{i}"], False) for i in range(5)]
    for t, _ in tokens:
        got = await h.engine.get_waitpoint(t.id, h.env.env_id)
        assert got is not None and got.status == "PENDING" and got.timeout_at is not None
    keyed = made[6]
    assert not isinstance(keyed, BaseException) and keyed[0].idempotency_key == "kept" and not keyed[1]


async def test_a_journal_asked_from_past_any_sequence_is_empty(h: Harness) -> None:
    run, s = await started_run(h)
    await h.engine.waitpoints.append_journal(run.id, s.snapshot.id, 0, "step", "k", 1)
    assert (await h.engine.resolved_journal(run.id, 2**31)).entries == []
    assert (await h.engine.resolved_journal(run.id, 10**30)).entries == []
    assert [e["sequence"] for e in (await h.engine.resolved_journal(run.id, 0)).entries] == [0]


async def test_a_failure_after_the_block_committed_does_not_fail_the_waits(h: Harness, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Redis away between the block statement and its jobs and acks: the waits are blocked (and
    suspended) all the same, and not written twice (a batch run again would find every run moved
    on); the slot a suspended run still holds is freed by the reconciler."""
    runs = [await started_run(h) for _ in range(3)]
    token, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    statements = count_items(monkeypatch, h.engine.resources.repo.waitpoints, "block_executing")

    async def down(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise ConnectionError("Redis is away")

    monkeypatch.setattr(h.engine.resources, "change_jobs", down)
    monkeypatch.setattr(h.engine.resources, "ack_many", down)
    out = await asyncio.gather(*(h.engine.block(r.id, s.snapshot.id, sequence=0, kind="token", key=token.id,
                                                waitpoint_ids=[token.id], suspend=n > 0)
                                 for n, (r, s) in enumerate(runs)))
    assert statements == [3]
    assert [(o.blocked, o.suspended, o.snapshot.engine_status) for o in out] == [
        (True, False, "EXECUTING_WITH_WAITPOINTS"), (True, True, "SUSPENDED"), (True, True, "SUSPENDED")]
    queue = h.engine.resources.queue
    assert {r.id for r, _ in runs} <= await queue.running_ids(h.env.env_id)  # the acks were lost
    monkeypatch.undo()  # Redis is back: the reconciler frees the suspended runs' slots
    await h.engine.systems.reconciler.reconcile(grace_s=-1, full=True)
    assert {r.id for r, _ in runs} & await queue.running_ids(h.env.env_id) == {runs[0][0].id}


async def test_a_wait_looked_up_by_environment_keys_its_entry_and_never_blocks_on_another_s(
        h: Harness, unique: str) -> None:
    """``block(env_id=...)``: the block statement itself checks that the waitpoint is one of the
    run's environment (nothing is written for another's, or an unknown id) and journals the wait
    under the waitpoint's key (a RUN waitpoint's run), with no query of its own before."""
    from run_engine.tenancy import ensure_environment

    other = await ensure_environment(h.engine.resources.repo, secret="test-secret", org=f"org-other-{unique}",
                                     project="proj", env="dev")
    theirs, _ = await h.engine.waitpoints.create_token(other.env_id)
    run, s = await started_run(h)
    for wp_id in (theirs.id, "waitpoint_unknown"):
        with pytest.raises(NotFoundError) as refused:
            await h.engine.block(run.id, s.snapshot.id, sequence=0, kind="token", key=wp_id, waitpoint_ids=[wp_id],
                                 suspend=True, env_id=h.env.env_id)
        assert refused.value.kind == "waitpoint"
    assert (await h.engine.latest_snapshot(run.id)).id == s.snapshot.id  # nothing written
    assert (await h.engine.journal(run.id)).entries == []

    child = await h.engine.trigger(req(h))
    child_wp = await h.engine.run_waitpoint(h.env.env_id, child.id)
    out = await h.engine.block(run.id, s.snapshot.id, sequence=0, kind="token", key="not-this",
                               waitpoint_ids=[child_wp.id], env_id=h.env.env_id)
    assert out.blocked
    (entry,) = (await h.engine.journal(run.id)).entries
    assert entry.key == child.id and entry.waitpoint_id == child_wp.id


async def test_completing_a_token_cancels_engine_jobs_only_of_waitpoints_that_have_them(
        h: Harness, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A token without a timeout has no engine job: its completion makes no jobs call; a token
    with one has its timeout job cancelled."""
    from systems import engine_jobs

    jobs = h.engine.resources.jobs
    cancelled: list[list[str]] = []
    apply = jobs.apply

    async def counted(cancel, schedule):  # type: ignore[no-untyped-def]
        cancelled.append(list(cancel))
        await apply(cancel, schedule)

    monkeypatch.setattr(jobs, "apply", counted)
    plain, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    timed, _ = await h.engine.waitpoints.create_token(h.env.env_id, timeout_s=3600)
    assert await jobs.get(engine_jobs.waitpoint_timeout_id(timed.id)) is not None
    cancelled.clear()
    assert await h.engine.complete_waitpoint(plain.id, 1, env_id=h.env.env_id)
    assert cancelled == []
    assert await h.engine.complete_waitpoint(timed.id, 2, env_id=h.env.env_id)
    assert [c for c in cancelled if c] == [[engine_jobs.waitpoint_timeout_id(timed.id),
                                            engine_jobs.waitpoint_datetime_id(timed.id)]]
    assert await jobs.get(engine_jobs.waitpoint_timeout_id(timed.id)) is None


async def test_a_dequeue_that_starts_a_restored_run_reads_its_journal_in_the_same_statement(
        h: Harness, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A restored run started by its dequeue comes with its resolved journal (the step and the
    completed token) from the dequeue's own statement: no journal query of its own, the same
    entries as ``resolved_journal``. A first attempt comes with none to read."""
    run, s = await started_run(h)
    await h.engine.append_journal(run.id, s.snapshot.id, 0, "step", "a", {"v": 1})
    token, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    out = await h.engine.block(run.id, s.snapshot.id, sequence=1, kind="token", key=token.id,
                               waitpoint_ids=[token.id], suspend=True)
    assert out.suspended
    fresh = await h.engine.trigger(req(h))
    assert await h.engine.waitpoints.complete(token.id, {"approved": True})
    sizes = count_items(monkeypatch, h.engine.resources.repo.waitpoints, "journals")
    got = {d.run.id: d for d in await h.engine.dequeue(h.env.worker_group_id, 10, start=True)}
    assert sizes == []  # no journal query: the dequeue's statement read it
    restored, first = got[run.id].started, got[fresh.id].started
    assert restored is not None and first is not None
    assert restored.snapshot.checkpoint_id is not None and first.journal is None
    assert restored.journal is not None
    assert restored.journal.entries == (await h.engine.resolved_journal(run.id)).entries == [
        {"sequence": 0, "kind": "step", "key": "a", "resolved": True, "result": {"v": 1}},
        {"sequence": 1, "kind": "token", "key": token.id, "resolved": True,
         "result": {"ok": True, "output": {"approved": True}}}]


async def test_a_completion_whose_continuation_fails_is_answered_and_the_sweeper_continues(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Completed is completed: a failure after the completion's commit does not fail its caller
    (the batcher would complete it again and find it done); the sweeper continues the run."""
    run, s = await started_run(h)
    token, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    await h.engine.block(run.id, s.snapshot.id, sequence=0, kind="token", key=token.id, waitpoint_ids=[token.id])
    wp = h.engine.systems.waitpoints.wp

    async def lost(waitpoint_ids: object) -> list[tuple[str, str]]:
        raise ConnectionError("connection lost after the commit")

    monkeypatch.setattr(wp, "blocked_runs", lost)
    assert await h.engine.waitpoints.complete(token.id, "yes") is True
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "EXECUTING_WITH_WAITPOINTS"
    monkeypatch.undo()
    await h.engine.waitpoints.sweep(grace_s=0)
    latest = await h.engine.latest_snapshot(run.id)
    assert latest.engine_status == "EXECUTING" and latest.completed_waitpoint_ids == [token.id]


async def test_a_child_reported_finished_twice_counts_once_in_its_batch(h: Harness) -> None:
    """A child that finishes twice (dead-lettered, redriven, finished again) or whose finish is
    reported twice must not end its parent's batch wait while another child still runs."""
    parent, s = await started_run(h)
    ids, out = await h.engine.trigger_and_wait(parent.id, s.snapshot.id, 0,
                                               [req(h, payload=i) for i in range(3)], batch=True)
    await h.engine.suspend(parent.id, out.snapshot.id)
    got = {d.run.id: d for d in await h.engine.dequeue(h.env.worker_group_id, 10)}

    async def finish(child: str) -> None:
        st = await h.engine.start_attempt(child, got[child].snapshot.id)
        await h.engine.complete_attempt(child, st.snapshot.id, ok=True, output=1)

    await finish(ids[0])
    first = await h.engine.get_run(ids[0])
    assert first is not None
    await h.engine.systems.waitpoints.on_runs_finished([first])  # reported again
    await finish(ids[1])
    assert (await h.engine.latest_snapshot(parent.id)).engine_status == "SUSPENDED"  # ids[2] still runs
    await finish(ids[2])
    assert (await h.engine.latest_snapshot(parent.id)).engine_status == "QUEUED_EXECUTING"


async def test_a_batch_wait_that_joined_a_running_run_waits_for_it_too(h: Harness) -> None:
    """An item whose idempotency key names a run still going: the batch completes with the runs it
    created, and the parent waited no longer (it resumed with that item unfinished)."""
    parent, s = await started_run(h)
    holder = await h.engine.trigger(req(h, payload="slow", idempotency_key="slow-1"))
    ids, out = await h.engine.trigger_and_wait(parent.id, s.snapshot.id, 0,
                                               [req(h, payload="slow", idempotency_key="slow-1"),
                                                req(h, payload="fast")], batch=True)
    assert ids[0] == holder.id and out.blocked
    got = {d.run.id: d for d in await h.engine.dequeue(h.env.worker_group_id, 10)}

    async def finish(child: str, output: str) -> None:
        st = await h.engine.start_attempt(child, got[child].snapshot.id)
        await h.engine.complete_attempt(child, st.snapshot.id, ok=True, output=output)

    await finish(ids[1], "fast done")
    await h.engine.waitpoints.sweep(grace_s=0)
    assert (await h.engine.latest_snapshot(parent.id)).engine_status == "EXECUTING_WITH_WAITPOINTS"
    await finish(holder.id, "slow done")
    await h.engine.waitpoints.sweep(grace_s=0)  # the holder was not triggered to wait: at the latest the sweeper
    assert (await h.engine.latest_snapshot(parent.id)).engine_status == "EXECUTING"
    (entry,) = (await h.engine.waitpoints.resolved_journal(parent.id)).entries
    assert [r["output"] for r in entry["result"]] == ["slow done", "fast done"]


async def test_a_repeated_batch_trigger_whose_first_try_failed_waits_on_runs_its_keys_name(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call journaled the wait and failed before its children existed; the repeat finds an
    item's key held by another run: the parent waits on that run (the sweeper failed the wait, the
    batch short of a run it would never get)."""
    parent, s = await started_run(h)
    holder = await h.engine.trigger(req(h, payload="theirs", idempotency_key="shared"))
    items = [req(h, payload="theirs", idempotency_key="shared"), req(h, payload="mine")]
    enqueue = h.engine.systems.waitpoints.enqueue
    fail_once(monkeypatch, enqueue, "trigger_many")
    with pytest.raises(ConnectionError):
        await h.engine.trigger_and_wait(parent.id, s.snapshot.id, 0, items, batch=True)
    ids, out = await h.engine.trigger_and_wait(parent.id, s.snapshot.id, 0, items, batch=True)
    assert ids[0] == holder.id and out.blocked
    got = {d.run.id: d for d in await h.engine.dequeue(h.env.worker_group_id, 10)}
    for child in ids:
        st = await h.engine.start_attempt(child, got[child].snapshot.id)
        await h.engine.complete_attempt(child, st.snapshot.id, ok=True, output=f"{child} done")
    await h.engine.waitpoints.sweep(grace_s=0)
    assert (await h.engine.latest_snapshot(parent.id)).engine_status == "EXECUTING"
    (entry,) = (await h.engine.waitpoints.resolved_journal(parent.id)).entries
    assert [r.get("output") for r in entry["result"]] == [f"{child} done" for child in ids]


async def test_a_repeated_batch_trigger_still_waits_on_a_run_its_first_try_joined_before_failing(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call named the run an item's key holds in the journal, then failed before blocking
    on it; the repeat found every run there and blocked on the batch alone: the parent resumed
    before that run finished, and was told it ended DEQUEUED."""
    parent, s = await started_run(h)
    holder = await h.engine.trigger(req(h, payload="slow", idempotency_key="slow-1"))
    wps = h.engine.systems.waitpoints
    fail_once(monkeypatch, wps, "run_waitpoint")
    items = [req(h, payload="slow", idempotency_key="slow-1"), req(h, payload="fast")]
    with pytest.raises(ConnectionError):
        await h.engine.trigger_and_wait(parent.id, s.snapshot.id, 0, items, batch=True)
    ids, out = await h.engine.trigger_and_wait(parent.id, s.snapshot.id, 0, items, batch=True)
    assert ids[0] == holder.id and out.blocked
    got = {d.run.id: d for d in await h.engine.dequeue(h.env.worker_group_id, 10)}
    st = await h.engine.start_attempt(ids[1], got[ids[1]].snapshot.id)
    await h.engine.complete_attempt(ids[1], st.snapshot.id, ok=True, output="fast done")
    await h.engine.waitpoints.sweep(grace_s=0)
    assert (await h.engine.latest_snapshot(parent.id)).engine_status == "EXECUTING_WITH_WAITPOINTS"
    st = await h.engine.start_attempt(holder.id, got[holder.id].snapshot.id)
    await h.engine.complete_attempt(holder.id, st.snapshot.id, ok=True, output="slow done")
    await h.engine.waitpoints.sweep(grace_s=0)
    assert (await h.engine.latest_snapshot(parent.id)).engine_status == "EXECUTING"
    (entry,) = (await h.engine.waitpoints.resolved_journal(parent.id)).entries
    assert [r.get("output") for r in entry["result"]] == ["slow done", "fast done"]


async def test_a_repeated_trigger_creates_no_children_for_a_parent_cancelled_meanwhile(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call journaled the wait and failed before its child existed; the parent was
    cancelled (nothing to cascade to yet); the supervisor's repeat created the child all the same,
    and it ran for a parent that was gone."""
    parent, s = await started_run(h)
    enqueue = h.engine.systems.waitpoints.enqueue
    fail_once(monkeypatch, enqueue, "trigger_many")
    with pytest.raises(ConnectionError):
        await h.engine.trigger_and_wait(parent.id, s.snapshot.id, 0, [req(h, payload="child")])
    await h.engine.cancel(parent.id)
    with pytest.raises((StaleSnapshotError, InvalidTransitionError)):
        await h.engine.trigger_and_wait(parent.id, s.snapshot.id, 0, [req(h, payload="child")])
    assert await h.engine.dequeue(h.env.worker_group_id, 10) == []
    assert await h.engine.resources.repo.runs.child_runs(parent.id) == []


async def test_a_repeated_trigger_creates_no_child_once_the_sweeper_failed_its_wait(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """After an outage past the grace the sweeper fails the wait as never created; a repeat that
    came after it made the child all the same: the parent was told its child never existed while
    the child ran (a parent that triggers again on that error ran the work twice). The sweeper and
    the repeat take the parent's lock, and each checks again under it."""
    parent, s = await started_run(h)
    enqueue = h.engine.systems.waitpoints.enqueue
    fail_once(monkeypatch, enqueue, "trigger_many")
    with pytest.raises(ConnectionError):
        await h.engine.trigger_and_wait(parent.id, s.snapshot.id, 0, [req(h, payload="child")])
    # the repeat read the wait as pending just before the sweeper failed it
    wps = h.engine.systems.waitpoints
    real_create = wps._create_missing_children

    async def after_the_sweeper(*args: Any, **kwargs: Any) -> Any:
        await wps.sweep(grace_s=0)
        return await real_create(*args, **kwargs)

    monkeypatch.setattr(wps, "_create_missing_children", after_the_sweeper)
    _, out = await h.engine.trigger_and_wait(parent.id, s.snapshot.id, 0, [req(h, payload="child")])
    assert not out.blocked
    assert await h.engine.dequeue(h.env.worker_group_id, 10) == []
    assert await h.engine.resources.repo.runs.child_runs(parent.id) == []


async def test_a_batchs_results_past_their_byte_limit_are_replayed_as_errors(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The results a parent waited on are loaded within a byte budget (a batch of a thousand 3 MiB
    outputs must not take 3 GB of the server's memory): past it, a child's result replays as a
    RESULT_TOO_LARGE error, the same at every replay; its run is untouched."""
    import systems.waitpoints

    parent, s = await started_run(h)
    ids, out = await h.engine.trigger_and_wait(parent.id, s.snapshot.id, 0,
                                               [req(h, payload=i, max_attempts=1) for i in range(4)], batch=True)
    await h.engine.suspend(parent.id, out.snapshot.id)
    for d in await h.engine.dequeue(h.env.worker_group_id, 10):
        st = await h.engine.start_attempt(d.run.id, d.snapshot.id)
        await h.engine.complete_attempt(d.run.id, st.snapshot.id, ok=True, output="r" * 1000)
    monkeypatch.setattr(systems.waitpoints, "RESULTS_BYTES", 2500)
    for _ in range(2):
        (entry,) = (await h.engine.waitpoints.resolved_journal(parent.id)).entries
        assert [r["ok"] for r in entry["result"]] == [True, True, False, False]
        assert [r["id"] for r in entry["result"]] == ids
        assert entry["result"][0]["output"] == "r" * 1000
        assert entry["result"][3]["error"]["type"] == "RESULT_TOO_LARGE"
    child = await h.engine.get_run(ids[3])
    assert child is not None and child.output == "r" * 1000


async def test_an_idempotency_key_of_one_kind_of_waitpoint_is_refused_for_another(h: Harness) -> None:
    """A token created with the key of a date wait came back as that date (resumed then, with no
    output), and a date wait with a token's key blocked on the token (never resumed): refused."""
    from datetime import timedelta

    from run_engine.errors import ConflictError

    wps = h.engine.systems.waitpoints
    at = datetime.fromtimestamp(h.clock.now(), UTC) + timedelta(minutes=5)
    date = await wps.create_datetime(h.env.env_id, at, idempotency_key="k-date")
    with pytest.raises(ConflictError, match="DATETIME"):
        await wps.create_token(h.env.env_id, idempotency_key="k-date")
    token, _ = await wps.create_token(h.env.env_id, idempotency_key="k-token")
    with pytest.raises(ConflictError, match="MANUAL"):
        await wps.create_datetime(h.env.env_id, at, idempotency_key="k-token")
    assert (await wps.create_datetime(h.env.env_id, at, idempotency_key="k-date")).id == date.id
    again, cached = await wps.create_token(h.env.env_id, idempotency_key="k-token")
    assert cached and again.id == token.id


async def test_a_token_key_with_a_ttl_of_zero_is_not_kept(h: Harness) -> None:
    wps = h.engine.systems.waitpoints
    first, _ = await wps.create_token(h.env.env_id, idempotency_key="k0", idempotency_key_ttl_s=0)
    h.clock.advance(0.001)
    second, cached = await wps.create_token(h.env.env_id, idempotency_key="k0", idempotency_key_ttl_s=0)
    assert not cached and second.id != first.id


async def test_a_callback_counts_against_its_environments_rate_and_a_completed_token_reads_no_body(
        h: Harness, api: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A callback URL is handed to outside systems and never expires: each call is counted against
    the token's environment, and once the token is completed a call is answered without its body
    being read or written (the first completion won)."""
    ctx = api._transport.app.state.ctx
    made = (await api.post("/api/v1/waitpoints/tokens", json={})).json()
    url = made["url"].removeprefix("http://t")
    buckets: list[str] = []
    real = ctx.check_limit

    async def counted(bucket: str) -> None:
        buckets.append(bucket)
        await real(bucket)

    monkeypatch.setattr(ctx, "check_limit", counted)
    first = await api.post(url, json={"n": 1}, headers={"Authorization": ""})
    assert first.status_code == 200 and buckets == [f"env:{h.env.env_id}"]
    writes: list[str] = []
    complete = ctx.engine.complete_waitpoint

    async def spy(*args: Any, **kwargs: Any) -> Any:
        writes.append(args[0])
        return await complete(*args, **kwargs)

    monkeypatch.setattr(ctx.engine, "complete_waitpoint", spy)
    again = await api.post(url, content=b"{" * 10, headers={"Authorization": "", "Content-Type": "application/json"})
    assert again.status_code == 200 and writes == [] and len(buckets) == 2
    token = (await api.get(f"/api/v1/waitpoints/tokens/{made['id']}")).json()
    assert token["status"] == "COMPLETED" and token["output"] == {"n": 1}


async def test_a_token_takes_one_tag_as_a_string_and_refuses_a_timeout_of_true(api: Any) -> None:
    made = await api.post("/api/v1/waitpoints/tokens", json={"tags": "order-1"})
    assert made.status_code == 200, made.text
    assert (await api.get(f"/api/v1/waitpoints/tokens/{made.json()['id']}")).json()["tags"] == ["order-1"]
    assert (await api.post("/api/v1/waitpoints/tokens", json={"tags": None})).status_code == 200
    for bad in ({"timeout": True}, {"idempotencyKey": "k", "idempotencyKeyTTL": False}, {"tags": [""]}):
        assert (await api.post("/api/v1/waitpoints/tokens", json=bad)).status_code == 400, bad


async def test_the_token_list_honours_the_key_and_creation_filters(h: Harness, api: Any) -> None:
    """Trigger.dev's wait.listTokens filters: a caller that looks a token up by its key and completes
    the first one it gets must get that one (the filter was dropped: the newest token of all)."""
    first = (await api.post("/api/v1/waitpoints/tokens", json={"idempotencyKey": "order-1"})).json()
    await api.post("/api/v1/waitpoints/tokens", json={"idempotencyKey": "order-2"})
    await api.post("/api/v1/waitpoints/tokens", json={})

    async def ids(**params: str) -> list[str]:
        got = await api.get("/api/v1/waitpoints/tokens", params=params)
        assert got.status_code == 200, got.text
        return [t["id"] for t in got.json()["data"]]

    assert await ids(**{"filter[idempotencyKey]": "order-1"}) == [first["id"]]
    assert len(await ids(**{"filter[createdAt][period]": "1h"})) == 3
    assert await ids(**{"filter[createdAt][to]": "2000-01-01T00:00:00Z"}) == []
    assert len(await ids(**{"filter[createdAt][from]": "2000-01-01T00:00:00Z"})) == 3
    h.clock.advance(2 * 3600)
    assert await ids(**{"filter[createdAt][period]": "1h"}) == []
    for bad in ({"filter[createdAt][period]": "soon"}, {"filter[createdAt][from]": "yesterday"},
                {"filter[idempotencyKey]": "k" * 257}):
        assert (await api.get("/api/v1/waitpoints/tokens", params=bad)).status_code == 400, bad


async def test_two_completions_of_one_token_in_one_batch_the_first_callers_wins(h: Harness) -> None:
    """Concurrent completions share one statement: of two of the same token, the earlier caller's
    output is kept and only that caller hears it completed; another environment's completion ahead
    of them neither wins nor keeps the owner's from winning."""
    from run_engine.db.waitpoints import Completion
    from run_engine.tenancy import ensure_environment

    wps = h.engine.systems.waitpoints
    other = await ensure_environment(h.engine.resources.repo, secret="test-secret", org="wp-other", project="p",
                                     env="dev")
    for trial in range(5):  # the order in the statement, not PostgreSQL's join order, decides
        token, _ = await wps.create_token(h.env.env_id)
        got = await wps._complete_batch([
            Completion({"from": "intruder"}, id=token.id, env_id=other.env_id),
            Completion({"from": "first", "trial": trial}, id=token.id, env_id=h.env.env_id),
            Completion({"from": "second"}, id=token.id, env_id=h.env.env_id),
            Completion({"from": "third"}, id=token.id)])
        assert got == [False, True, False, False]
        stored = await h.engine.get_waitpoint(token.id)
        assert stored is not None and stored.output == {"from": "first", "trial": trial}


async def test_a_run_that_would_wait_on_itself_or_its_parent_by_a_key_gets_an_error_not_a_hang(h: Harness) -> None:
    """A child's idempotency key names the run that asks (or a run it descends from): that run
    finishes only after this wait, so the wait ends at once with CHILD_TRIGGER_FAILED."""
    parent = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", idempotency_key="self"))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1)
    started = await h.engine.start_attempt(parent.id, d.snapshot.id)
    ids, outcome = await h.engine.trigger_and_wait(
        parent.id, started.snapshot.id, 0, [TriggerRequest(env_id=h.env.env_id, task_id="hello",
                                                           idempotency_key="self")])
    assert ids == [parent.id] and not outcome.blocked
    (entry,) = (await h.engine.systems.waitpoints.resolved_journal(parent.id)).entries
    assert entry["resolved"] and entry["result"]["ok"] is False
    assert entry["result"]["error"]["type"] == "CHILD_TRIGGER_FAILED"


async def test_a_repeat_of_a_wait_on_itself_that_failed_before_ending_the_wait_ends_it(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call named the run itself in the journal and failed before failing the wait: the
    repeat found every run there and blocked on itself, for ever."""
    parent = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", idempotency_key="me"))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1)
    started = await h.engine.start_attempt(parent.id, d.snapshot.id)
    wps = h.engine.systems.waitpoints
    fail_once(monkeypatch, wps, "_fail_self_wait")
    child = [TriggerRequest(env_id=h.env.env_id, task_id="hello", idempotency_key="me")]
    with pytest.raises(ConnectionError):
        await h.engine.trigger_and_wait(parent.id, started.snapshot.id, 0, child)
    ids, outcome = await h.engine.trigger_and_wait(parent.id, started.snapshot.id, 0, child)
    assert ids == [parent.id] and not outcome.blocked
    (entry,) = (await wps.resolved_journal(parent.id)).entries
    assert entry["result"]["error"]["type"] == "CHILD_TRIGGER_FAILED"


async def test_the_sweeper_walks_waiting_runs_and_run_waitpoints_a_slice_a_pass(h: Harness, database_url: str,
                                                                               unique: str) -> None:
    """Each pass reads a slice from where the last one stopped and the walk starts over after the
    last slice: a pass costs the same whatever one tenant keeps waiting, and nothing is missed."""
    import psycopg

    from run_engine.db.waitpoints import SweepCursors

    tokens = []
    for _ in range(7):
        run, s = await started_run(h)
        token, _ = await h.engine.create_token(h.env.env_id)
        assert (await h.engine.block(run.id, s.snapshot.id, sequence=0, kind="token", key=token.id,
                                     waitpoint_ids=[token.id])).blocked
        tokens.append((run.id, token.id))
    tokens.sort()  # walked in run id order
    stuck = {tokens[1][0], tokens[5][0]}
    with psycopg.connect(database_url, autocommit=True) as conn:  # completed, their continuations lost
        conn.execute("UPDATE waitpoint SET status = 'COMPLETED' WHERE id = ANY(%s)",
                     ([t for r, t in tokens if r in stuck],))
        # RUN waitpoints whose child was never created (an orphan past the grace) among others
        conn.execute("INSERT INTO waitpoint (id, environment_id, type, status, completed_by_run_id, created_at) "
                     "SELECT 'waitpoint_o" + unique + "' || g, %s, 'RUN', 'PENDING', 'run_never_' || g, "
                     "now() - interval '1 hour' FROM generate_series(1, 5) g", (h.env.env_id,))
    repo = h.engine.resources.repo.waitpoints
    try:
        found_stuck: list[str] = []
        orphans: list[str] = []
        cursors = SweepCursors()
        walked: list[SweepCursors] = []
        while True:  # (the database holds other tests' waiting runs too: walk it all once)
            found, cursors = await repo.sweep_candidates(grace_s=0, cursors=cursors, walk=3)
            found_stuck += found["stuck_runs"]
            orphans += found["orphaned"]
            assert len(found["orphaned"]) <= 3 and len(found["stuck_runs"]) <= 3
            walked.append(cursors)
            if cursors.runs == "" and any(c.waitpoints == "" for c in walked):
                break
            assert len(walked) < 1000
        assert stuck <= set(found_stuck)
        assert {f"waitpoint_o{unique}{g}" for g in range(1, 6)} <= set(orphans)
        runs_after = [c.runs for c in walked[:-1]]
        assert len(walked) >= 3 and runs_after == sorted(runs_after) and "" not in runs_after  # on, slice by slice
        # the sweep repairs what it found: the stuck runs go on, the orphans fail their waits
        (done, _) = await h.engine.waitpoints.sweep(grace_s=0)
        assert done["stuck_runs"] >= 2
        for run_id in stuck:
            assert (await h.engine.latest_snapshot(run_id)).engine_status == "EXECUTING"
    finally:  # other tests sweep this database too
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("DELETE FROM waitpoint WHERE id LIKE %s", (f"waitpoint_o{unique}%",))


async def test_an_engine_start_keeps_where_the_sweepers_walk_stands(database_url: str, redis_url: str,
                                                                    key_prefix: str, unique: str) -> None:
    """Each start armed the sweep job afresh, its cursors back at the start: with servers restarted
    more often than one walk takes (deploys), the later part of the walk was never reached."""
    from run_engine.clock import FakeClock
    from run_engine.db.waitpoints import SweepCursors
    from run_engine.engine import RunEngine
    from run_engine.settings import EngineSettings
    from systems import engine_jobs

    settings = EngineSettings(database_url=database_url, redis_url=redis_url, key_prefix=f"{key_prefix}:sw{unique}")
    first = await RunEngine.create(settings, clock=FakeClock())  # starts its job worker: arms the sweep
    try:
        assert await first.resources.jobs.get(engine_jobs.SWEEP_ID) is not None
        await first._schedule_sweep(SweepCursors(runs="run_m", waitpoints="waitpoint_m"))
    finally:
        await first.close()
    again = await RunEngine.create(settings, clock=FakeClock())
    try:
        found = await again.resources.jobs.get(engine_jobs.SWEEP_ID)
        assert found is not None
        assert found[0].payload == {"runs_after": "run_m", "waitpoints_after": "waitpoint_m"}
    finally:
        await again.close()


async def test_a_token_many_runs_wait_on_continues_them_a_page_at_a_time_in_its_environments_lane(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Thousands of runs waiting on one token: its completion answers once the token is complete
    and leaves their continuation to an engine job of the environment's lane, a page (one
    statement, one enqueue) at a time. Before, the completion continued and enqueued them all at
    once: one Lua call of every run, blocking Redis for every tenant, and the completion batch
    of every tenant's tokens held for as long."""
    wps = h.engine.systems.waitpoints
    monkeypatch.setattr(wps, "CONTINUE_PAGE", 4)
    token, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    other, _ = await h.engine.waitpoints.create_token(h.env.env_id)
    runs = []
    for i in range(11):
        run, s = await started_run(h)
        keys = [token.id, other.id] if i == 0 else [token.id]  # the first waits on both
        out = await h.engine.block(run.id, s.snapshot.id, sequence=0, kind="token", key=token.id, waitpoint_ids=keys)
        if i % 2:  # half suspended: restored through the queue
            await h.engine.suspend(run.id, out.snapshot.id)
        runs.append(run.id)
    enqueued = count_items(monkeypatch, h.engine.resources, "enqueue_items")
    assert await h.engine.waitpoints.complete(token.id, "go")
    statuses = {(await h.engine.latest_snapshot(r)).engine_status for r in runs}
    assert statuses == {"EXECUTING_WITH_WAITPOINTS", "SUSPENDED"}  # none continued by the completion itself
    assert enqueued == []
    assert await h.engine.run_due_jobs() == 3  # pages of 4, 4 and 3 runs (one still blocked)
    assert enqueued and max(enqueued) <= 4 and sum(enqueued) == 5
    latest = {r: (await h.engine.latest_snapshot(r)).engine_status for r in runs}
    assert latest[runs[0]] == "EXECUTING_WITH_WAITPOINTS"  # still waits on the other token
    assert {latest[r] for i, r in enumerate(runs) if i and i % 2} == {"QUEUED_EXECUTING"}
    assert {latest[r] for i, r in enumerate(runs) if i and not i % 2} == {"EXECUTING"}
    assert await h.engine.waitpoints.complete(other.id, "also")  # few runs: continued at once
    assert (await h.engine.latest_snapshot(runs[0])).engine_status == "EXECUTING"


async def test_a_batch_entry_naming_another_tenants_run_reads_nothing_of_it(h: Harness, unique: str) -> None:
    """A batch wait's results are read by the run ids its journal entry holds. The engine writes
    those ids, but whatever an entry holds, another environment's run is never read: it is a run
    that does not exist, as for ids that were never created."""
    from run_engine.db.waitpoints import NewWaitpoint
    from run_engine.tenancy import ensure_environment

    other = await ensure_environment(h.engine.resources.repo, secret="test-secret", org=f"org-other-{unique}",
                                     project="p", env="dev")
    secret = await h.engine.trigger(TriggerRequest(env_id=other.env_id, task_id="hello", payload={"s": 1}))
    async with h.engine.resources.repo.pool.connection() as conn:  # as if it had finished
        await conn.execute("""UPDATE task_run SET status = 'COMPLETED', output = '{"secret": "theirs"}'
                              WHERE id = %s""", (secret.id,))
    parent, s = await started_run(h)
    wp_repo = h.engine.resources.repo.waitpoints
    await wp_repo.insert_batch(f"batch_foreign_{unique}", h.env.env_id, 1, parent.id)
    wp, _ = await wp_repo.create(NewWaitpoint(id=f"waitpoint_foreign_{unique}", env_id=h.env.env_id, type="BATCH",
                                              completed_by_batch_id=f"batch_foreign_{unique}"))
    await h.engine.block(parent.id, s.snapshot.id, sequence=0, kind="batch", key=f"batch_foreign_{unique}",
                         waitpoint_ids=[wp.id], result={"runIds": [secret.id]})
    await h.engine.waitpoints.complete(wp.id, None)
    (entry,) = (await h.engine.waitpoints.resolved_journal(parent.id)).entries
    assert "theirs" not in str(entry) and "COMPLETED" not in str(entry)  # neither its output nor its status
    assert [r["ok"] for r in entry["result"]] == [False]
