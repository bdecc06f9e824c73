"""A run's snapshots stay one chain when two transitions race for the same snapshot without a run
lock (a successful completion takes none; a lock can be lost to a failover): the unique index on
``previous_snapshot_id`` makes the second one lose, and it reports the snapshot that won."""

from __future__ import annotations

import asyncio

import pytest
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from run_engine.db.runs import _TRANSITION_SQL, RunRepository, Transition
from run_engine.db.waitpoints import _SUSPEND, BlockWrite, JournalEntry
from run_engine.engine import TriggerRequest
from run_engine.errors import InvalidTransitionError, StaleSnapshotError
from run_engine.ids import new_id
from run_engine.statuses import RunStatus

from .conftest import Harness

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


async def executing(h: Harness) -> tuple[str, str]:
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1, start=True)
    assert d.started is not None and d.run.id == run.id
    return run.id, d.started.snapshot.id


def finish(run_id: str, expected: str) -> Transition:
    return Transition(run_id=run_id, new_snapshot_id=new_id("snapshot"), engine_status="FINISHED",
                      run_status="COMPLETED", from_statuses=("EXECUTING",), expected_snapshot_id=expected,
                      description="test", set_finished=True, output={"by": "first"})


async def valid_after(h: Harness, snapshot_id: str) -> list[str]:
    async with h.engine.resources.repo.pool.connection() as conn:
        cur = await conn.execute("SELECT id FROM task_run_execution_snapshot WHERE previous_snapshot_id = %s "
                                 "AND is_valid", (snapshot_id,))
        return [r[0] for r in await cur.fetchall()]


async def test_a_transition_that_loses_the_race_reports_the_winner_and_writes_nothing(h: Harness) -> None:
    run_id, executing_id = await executing(h)
    other, _ = await executing(h)
    first = finish(run_id, executing_id)
    async with h.engine.resources.repo.pool.connection() as conn:
        async with conn.transaction():
            # the first transition has appended, not committed: the second reads the same latest
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(_TRANSITION_SQL, RunRepository._transition_params([first]))
            assert (await cur.fetchone())["s.id"] == first.new_snapshot_id  # type: ignore[index]
            second = Transition(run_id=run_id, new_snapshot_id=new_id("snapshot"), engine_status="PENDING_CANCEL",
                                run_status="EXECUTING", from_statuses=("EXECUTING",),
                                expected_snapshot_id=executing_id, description="racing")
            other_done = finish(other, (await h.engine.latest_snapshot(other)).id)
            racing = asyncio.ensure_future(h.engine.resources.repo.runs.transition_many([second, other_done]))
            await asyncio.sleep(0.2)
            assert not racing.done()  # it waits on the first one's index entry
        lost, unrelated = await racing
    assert not lost.applied and lost.snapshot is None and lost.run is None
    assert lost.latest_snapshot_id == first.new_snapshot_id and lost.latest_status == "FINISHED"
    assert unrelated.applied  # one lost race does not fail the others of the statement
    assert await valid_after(h, executing_id) == [first.new_snapshot_id]
    row = await h.engine.get_run(run_id)
    assert row is not None and row.status == "COMPLETED" and row.output == {"by": "first"}
    assert await h.statuses(run_id) == ["QUEUED", "PENDING_EXECUTING", "EXECUTING", "FINISHED"]


async def test_a_block_that_loses_the_race_writes_nothing(h: Harness) -> None:
    run_id, executing_id = await executing(h)
    other, other_executing = await executing(h)
    token, _ = await h.engine.create_token(h.env.env_id)
    first = finish(run_id, executing_id)

    def write(run: str, expected: str) -> BlockWrite:
        return BlockWrite(run, expected, JournalEntry(0, "token", token.id, None, token.id), [token.id],
                          new_id("snapshot"), "racing")

    async with h.engine.resources.repo.pool.connection() as conn:
        async with conn.transaction():
            await conn.execute(_TRANSITION_SQL, RunRepository._transition_params([first]))
            racing = asyncio.ensure_future(h.engine.resources.repo.waitpoints.block_executing(
                [write(run_id, executing_id), write(other, other_executing)]))
            await asyncio.sleep(0.2)
            assert not racing.done()
        blocked, unrelated = await racing
    assert not blocked.transition.applied and blocked.transition.latest_snapshot_id == first.new_snapshot_id
    assert (await h.engine.journal(run_id)).entries == []  # nothing of the losing run was written
    assert await h.engine.blocking_waitpoints(run_id) == []
    # the other run of the same statement blocked all the same
    assert unrelated.transition.applied and [w.id for w in await h.engine.blocking_waitpoints(other)] == [token.id]
    assert [e.sequence for e in (await h.engine.journal(other)).entries] == [0]


async def test_duplicate_completions_without_a_lock_finish_the_run_once(h: Harness) -> None:
    runs = [await executing(h) for _ in range(20)]
    outcomes = await asyncio.gather(*(h.engine.complete_attempt(run_id, snap, ok=True, output=i)
                                      for run_id, snap in runs for i in (1, 2)), return_exceptions=True)
    for (run_id, snap), pair in zip(runs, zip(outcomes[::2], outcomes[1::2], strict=True), strict=True):
        won = [o for o in pair if not isinstance(o, BaseException)]
        assert len(won) == 1 and won[0].status == RunStatus.COMPLETED, pair
        assert all(isinstance(o, StaleSnapshotError) for o in pair if isinstance(o, BaseException)), pair
        assert len(await valid_after(h, snap)) == 1
        assert h.names(run_id).count("run_succeeded") == 1
    assert await h.engine.resources.queue.running_ids(h.env.env_id) == set()


async def test_a_completion_racing_a_cancel_ends_the_run_once(h: Harness) -> None:
    runs = [await executing(h) for _ in range(10)]
    results = await asyncio.gather(*(op for run_id, snap in runs for op in (
        h.engine.complete_attempt(run_id, snap, ok=True, output=1), h.engine.cancel(run_id))),
        return_exceptions=True)
    # a cancel never fails for the race (it reads again); a completion may find the cancel first
    assert not [r for r in results[1::2] if isinstance(r, BaseException)], results
    assert not [r for r in results[::2] if isinstance(r, BaseException) and not isinstance(r, StaleSnapshotError)]
    for run_id, snap in runs:
        row = await h.engine.get_run(run_id)
        assert row is not None
        assert len(await valid_after(h, snap)) == 1
        statuses = await h.statuses(run_id)
        # completed first, or cancel requested first (then the completion finishes the cancel)
        assert statuses in (["QUEUED", "PENDING_EXECUTING", "EXECUTING", "FINISHED"],
                            ["QUEUED", "PENDING_EXECUTING", "EXECUTING", "PENDING_CANCEL", "FINISHED"]), statuses
        assert row.status in ("COMPLETED", "CANCELED")


async def test_a_start_that_beats_the_pending_timeout_keeps_the_queue_untouched(h: Harness) -> None:
    """The PENDING_EXECUTING timeout read the run before a start (which takes no lock) moved it
    on: its compare-and-set comes first, so it neither hands the message out again nor DLQs it."""
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1)
    started = await h.engine.start_attempt(run.id, d.snapshot.id)
    with pytest.raises(StaleSnapshotError):
        await h.engine.systems.dead_letter.requeue_undelivered(run.id, d.snapshot)  # what the timeout had read
    h.clock.advance(3600)  # past any nack back-off
    assert await h.engine.dequeue(h.env.worker_group_id, 5) == []  # not handed out again
    assert await h.engine.resources.queue.running_ids(h.env.env_id) == {run.id}  # its slot still held
    assert await h.engine.resources.queue.list_dlq(h.env.env_id) == []
    await h.engine.complete_attempt(run.id, started.snapshot.id, ok=True, output=1)
    assert await h.statuses(run.id) == ["QUEUED", "PENDING_EXECUTING", "EXECUTING", "FINISHED"]


async def test_dequeues_racing_cancels_hand_out_only_runs_they_moved_first(h: Harness) -> None:
    runs = [(await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))).id for _ in range(30)]
    # the cancels newest first, the dequeues (oldest first) a moment later: they meet in the middle
    cancels = [asyncio.ensure_future(h.engine.cancel(run_id)) for run_id in reversed(runs)]
    await asyncio.sleep(0.01)
    got = await asyncio.gather(*(h.engine.dequeue(h.env.worker_group_id, 3, start=True) for _ in range(10)))
    await asyncio.gather(*cancels)
    handed = {d.run.id for batch in got for d in batch}
    for run_id in runs:
        latest = await h.engine.latest_snapshot(run_id)
        if run_id in handed:  # started first: the cancel asks the executing run to stop
            assert latest.engine_status == "PENDING_CANCEL", run_id
        else:  # cancelled first: never handed out
            assert latest.engine_status == "FINISHED" and latest.run_status == "CANCELED", run_id
    h.clock.advance(3600)
    assert await h.engine.dequeue(h.env.worker_group_id, 50) == []  # nothing left to hand out
    assert await h.engine.resources.queue.running_ids(h.env.env_id) == handed


async def test_a_cancel_that_died_after_its_snapshot_leaves_nothing_to_hand_out(h: Harness) -> None:
    """Cancel and TTL expiry write the snapshot first, then touch the queue. A crash between the
    two leaves a FINISHED run whose message is still ready: the next dequeue's compare-and-set
    fails, it drops the message, and nothing is handed out or held."""
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    queued = await h.engine.latest_snapshot(run.id)
    await h.engine.systems.execution_snapshot.apply(  # the cancel's snapshot, and then the crash
        run.id, "FINISHED", RunStatus.CANCELED, from_statuses=("QUEUED",), expected_snapshot_id=queued.id,
        operation="cancel", description="Cancelled while QUEUED", set_finished=True)
    assert await h.engine.resources.queue.placements([(h.env.env_id, run.id)]) == ["ready"]
    assert await h.engine.dequeue(h.env.worker_group_id, 5, start=True) == []
    assert await h.engine.resources.queue.placements([(h.env.env_id, run.id)]) == [None]  # message gone
    assert await h.engine.resources.queue.running_ids(h.env.env_id) == set()
    assert await h.statuses(run.id) == ["QUEUED", "FINISHED"]


async def test_a_continue_that_loses_its_place_to_a_suspend_looks_again_and_restores_the_run(h: Harness) -> None:
    """Continue takes no run lock. A suspend counted the token as pending, then the token completed
    and its continue read the run as still EXECUTING_WITH_WAITPOINTS: both append after the same
    snapshot. The suspend wins; the continue must neither drop the blocking rows nor give up, or
    the run would stay suspended for ever with nothing left to wake it."""
    run_id, executing_id = await executing(h)
    token, _ = await h.engine.create_token(h.env.env_id)
    blocked = await h.engine.block(run_id, executing_id, sequence=0, kind="token", key=token.id,
                                   waitpoint_ids=[token.id])
    assert blocked.blocked
    suspended_id = new_id("snapshot")
    async with h.engine.resources.repo.pool.connection() as conn:
        async with conn.transaction():
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(_SUSPEND, {"rows": Jsonb([{"run_id": run_id, "expected": blocked.snapshot.id,
                                                         "checkpoint": new_id("checkpoint"), "new": suspended_id}])})
            assert (await cur.fetchone())["pending"] == 1  # type: ignore[index]
            completing = asyncio.ensure_future(h.engine.waitpoints.complete(token.id, "late"))
            await asyncio.sleep(0.3)
            assert not completing.done()  # its continue waits on the suspend's index entry
    assert await completing
    latest = await h.engine.latest_snapshot(run_id)
    assert latest.engine_status == "QUEUED_EXECUTING" and latest.previous_snapshot_id == suspended_id
    assert latest.completed_waitpoint_ids == [token.id]  # the losing attempt deleted nothing
    assert await h.statuses(run_id) == ["QUEUED", "PENDING_EXECUTING", "EXECUTING", "EXECUTING_WITH_WAITPOINTS",
                                        "SUSPENDED", "QUEUED_EXECUTING"]
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)  # queued to be restored
    assert d.run.id == run_id and d.snapshot.checkpoint_id is not None


async def test_one_completion_continues_every_run_it_blocked_in_one_go(h: Harness) -> None:
    token, _ = await h.engine.create_token(h.env.env_id)
    runs = [await executing(h) for _ in range(3)]
    blocked = [await h.engine.block(r, s, sequence=0, kind="token", key=token.id, waitpoint_ids=[token.id])
               for r, s in runs]
    for (run_id, _), b in zip(runs[:2], blocked[:2], strict=True):
        await h.engine.suspend(run_id, b.snapshot.id)
    assert await h.engine.waitpoints.complete(token.id, 1)
    assert not await h.engine.waitpoints.complete(token.id, 2)  # the first completion wins
    latest = [(await h.engine.latest_snapshot(r)).engine_status for r, _ in runs]
    assert latest == ["QUEUED_EXECUTING", "QUEUED_EXECUTING", "EXECUTING"]  # the third never left its executor
    for run_id, _ in runs:
        assert h.names(run_id).count("run_continued") == 1
    restored = {d.run.id for d in await h.engine.dequeue(h.env.worker_group_id, 10)}
    assert restored == {runs[0][0], runs[1][0]}


async def test_blocks_racing_cancels_without_a_lock_keep_one_chain(h: Harness) -> None:
    """A block (that suspends) takes no run lock: against a cancel, either the block wins and the
    cancel then cancels the suspended run, or the cancel wins and the block is refused; never both
    after the same snapshot, and a suspended-then-cancelled run holds no slot."""
    token, _ = await h.engine.create_token(h.env.env_id)
    runs = [await executing(h) for _ in range(10)]
    results = await asyncio.gather(*(op for run_id, snap in runs for op in (
        h.engine.block(run_id, snap, sequence=0, kind="token", key=token.id, waitpoint_ids=[token.id], suspend=True),
        h.engine.cancel(run_id))), return_exceptions=True)
    assert not [r for r in results[1::2] if isinstance(r, BaseException)], results  # a cancel reads again
    for (run_id, snap), blocked in zip(runs, results[::2], strict=True):
        assert len(await valid_after(h, snap)) == 1
        statuses = await h.statuses(run_id)
        if isinstance(blocked, BaseException):  # the cancel came first
            assert isinstance(blocked, StaleSnapshotError | InvalidTransitionError), blocked
            assert statuses == ["QUEUED", "PENDING_EXECUTING", "EXECUTING", "PENDING_CANCEL"], statuses
        else:
            assert blocked.suspended, blocked
            assert statuses == ["QUEUED", "PENDING_EXECUTING", "EXECUTING", "EXECUTING_WITH_WAITPOINTS", "SUSPENDED",
                                "FINISHED"], statuses
            assert run_id not in await h.engine.resources.queue.running_ids(h.env.env_id)
            assert (await h.engine.get_run(run_id)).status == "CANCELED"  # type: ignore[union-attr]


async def test_a_batch_whose_lookup_fails_after_its_commit_is_not_applied_again(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The statement committed, then the look-up of a lost race's winner failed: the batcher
    must not run the batch again (the transition that applied would be told its run moved on)."""
    from run_engine.batching import COMMITTED
    from run_engine.db import runs as runs_module

    run_id, executing_id = await executing(h)
    other, _ = await executing(h)
    first = finish(run_id, executing_id)
    monkeypatch.setattr(runs_module, "_LATEST_OF_RUNS", "SELECT no_such_function(%s)")
    transitions = h.engine.resources.transitions
    async with h.engine.resources.repo.pool.connection() as conn:
        async with conn.transaction():
            await conn.execute(_TRANSITION_SQL, RunRepository._transition_params([first]))
            second = Transition(run_id=run_id, new_snapshot_id=new_id("snapshot"), engine_status="PENDING_CANCEL",
                                run_status="EXECUTING", from_statuses=("EXECUTING",),
                                expected_snapshot_id=executing_id, description="racing")
            other_done = finish(other, (await h.engine.latest_snapshot(other)).id)
            racing = asyncio.gather(transitions.submit(second), transitions.submit(other_done),
                                    return_exceptions=True)
            await asyncio.sleep(0.2)
            assert not racing.done()
    lost, unrelated = await racing
    # both callers lose their answer (as over a dropped connection); nothing is written twice
    assert isinstance(lost, Exception) and COMMITTED in lost.__notes__
    assert isinstance(unrelated, Exception) and COMMITTED in unrelated.__notes__
    assert await h.statuses(other) == ["QUEUED", "PENDING_EXECUTING", "EXECUTING", "FINISHED"]
    assert await valid_after(h, executing_id) == [first.new_snapshot_id]


async def test_a_block_whose_lookup_fails_after_its_commit_says_so(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    from run_engine.batching import COMMITTED
    from run_engine.db.waitpoints import WaitpointRepository

    run_id, executing_id = await executing(h)
    other, other_executing = await executing(h)
    token, _ = await h.engine.create_token(h.env.env_id)

    async def lost(self: WaitpointRepository, run_id: str) -> None:
        raise ConnectionError("connection lost after the commit")

    monkeypatch.setattr(WaitpointRepository, "_moved_on", lost)
    async with h.engine.resources.repo.pool.connection() as conn:
        async with conn.transaction():
            await conn.execute(_TRANSITION_SQL, RunRepository._transition_params([finish(run_id, executing_id)]))
            racing = asyncio.ensure_future(h.engine.resources.repo.waitpoints.block_executing(
                [BlockWrite(r, e, JournalEntry(0, "token", token.id, None, token.id), [token.id], new_id("snapshot"),
                            "racing") for r, e in ((run_id, executing_id), (other, other_executing))]))
            await asyncio.sleep(0.2)
    with pytest.raises(ConnectionError) as raised:
        await racing
    assert COMMITTED in raised.value.__notes__
    assert [w.id for w in await h.engine.blocking_waitpoints(other)] == [token.id]  # its write stands


async def test_a_dequeue_whose_lookup_fails_after_its_commit_still_hands_its_runs_over(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))

    async def lost(conn: object, rows: object) -> dict[str, tuple[str, str]]:
        raise ConnectionError("connection lost after the commit")

    monkeypatch.setattr(RunRepository, "_winners", staticmethod(lost))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1, start=True)
    assert d.run.id == run.id and d.started is not None
