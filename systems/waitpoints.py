"""WaitpointsSystem: create and complete waitpoints, block runs on them, continue runs whose last
waitpoint completed, checkpoint (suspend) blocked runs, and sweep what a crash left behind.

A run blocks while EXECUTING (→ EXECUTING_WITH_WAITPOINTS, still in its executor, still holding
its slot). The supervisor suspends it after a grace period (→ SUSPENDED: REPLAY checkpoint at the
journal position, slot released). When its waitpoints are all complete it continues: in place
(→ EXECUTING) or, when suspended, back into the queue at its original place (→ QUEUED_EXECUTING),
from where the next executor restores it by replaying the journal.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from run_engine.batching import Batcher
from run_engine.db.runs import RunRow, Snapshot, TransitionResult
from run_engine.db.waitpoints import (
    RESULTS_BYTES,
    BlockWrite,
    Completion,
    JournalEntry,
    JournalPage,
    NewWaitpoint,
    SweepCursors,
    Waitpoint,
)
from run_engine.dependencies import log_failure
from run_engine.errors import (
    ConflictError,
    DuplicateExecutionError,
    InvalidTransitionError,
    LockTimeoutError,
    NotFoundError,
    QueueFullError,
    StaleSnapshotError,
    ValidationError,
)
from run_engine.events import RunEvent
from run_engine.ids import new_id
from run_engine.statuses import EXECUTING, FINAL_RUN_STATUSES, ExecutionStatus, RunStatus
from systems import engine_jobs
from systems.resources import SystemResources

if TYPE_CHECKING:
    from systems.enqueue import EnqueueSystem
    from systems.execution_snapshot import ExecutionSnapshotSystem

log = logging.getLogger(__name__)
E = ExecutionStatus
#: errors creating a trigger-and-wait's children that another try would meet again: they fail the wait
CHILDREN_REFUSED = (ValidationError, QueueFullError, ConflictError, NotFoundError)
#: the key of a trigger-and-wait journal entry's stored result: the children's ids (the SDK replays it)
RUN_IDS = "runIds"
#: how far up its parent chain a run is read when a wait might name a run it descends from (a
#: look-up a level: a tree deeper than this costs no more, and a wait that far up is not caught)
ANCESTRY_READ_MOST = 100


def _day_after(at: datetime) -> datetime:
    """A day after ``at``, or the last moment Python can hold (a wait until 9999-12-31)."""
    try:
        return at + timedelta(days=1)
    except OverflowError:
        return datetime.max.replace(tzinfo=UTC)


def batch_runs(result: Any) -> list[str]:
    """The run ids a batch wait's journal entry holds (none if it holds none: an entry written
    before waits on a batch were checked may hold nothing)."""
    runs = result.get(RUN_IDS) if isinstance(result, dict) else None
    return [r for r in runs if isinstance(r, str)] if isinstance(runs, list) else []


def is_batch_entry(result: Any) -> bool:
    """Whether a journal entry's stored result names a batch's runs."""
    return isinstance(result, dict) and isinstance(result.get(RUN_IDS), list)


def _gone(e: JournalEntry) -> bool:
    """A wait whose waitpoint no longer exists: one retention deleted, which it does only once it
    has completed. A block now never journals a waitpoint deleted (it locks the one it names, and
    retention checks again under its own lock); an entry written before that names a run's
    waitpoint replays as that run's outcome, if it is still there, else as a WAITPOINT_DELETED
    error; a duration as over; a batch as its runs' results."""
    return e.kind != "step" and e.waitpoint_id is not None and e.waitpoint_status is None


def _done(e: JournalEntry) -> bool:
    """A wait whose waitpoint has completed (or is gone: see _gone)."""
    return e.waitpoint_status == "COMPLETED" or _gone(e)


TOKEN_TIMEOUT_ERROR = {"type": "WAITPOINT_TIMEOUT", "message": "The token timed out before it was completed"}


@dataclass(frozen=True, slots=True)
class ResolvedJournal:
    """A page of a journal as a replay reads it, and the sequence of the next page (None: no more)."""

    entries: list[dict[str, Any]]
    next: int | None = None


@dataclass(frozen=True, slots=True)
class BlockOutcome:
    """``blocked``: the run now waits (EXECUTING_WITH_WAITPOINTS); otherwise the wait is over and
    ``entry`` is its resolved journal entry. ``snapshot`` is the run's latest snapshot.
    ``suspended``: the run was also checkpointed (a wait asked to suspend at once): its executor
    stops, and the run comes back through the queue to be restored by replay."""

    blocked: bool
    snapshot: Snapshot
    entry: dict[str, Any] | None = None
    suspended: bool = False


@dataclass(frozen=True, slots=True)
class BlockCall:
    """One :meth:`WaitpointsSystem.block` call, as the batch of concurrent ones carries it."""

    run_id: str
    snapshot_id: str
    sequence: int
    kind: str
    key: str
    waitpoint_ids: tuple[str, ...]
    result: Any = None
    suspend: bool = False
    env_id: str | None = None  # the waitpoint must be of this environment; the key is then its own


def run_result(run_id: str, status: str, output: Any, error: Any) -> dict[str, Any]:
    """What a parent sees of a finished child: ``{ok, id, output}`` or ``{ok: False, id, error}``."""
    if status == RunStatus.COMPLETED:
        return {"ok": True, "id": run_id, "output": output}
    return {"ok": False, "id": run_id,
            "error": error or {"type": status, "message": f"the run ended {status}"}}


class WaitpointsSystem:
    def __init__(self, resources: SystemResources, *, execution_snapshot: ExecutionSnapshotSystem,
                 enqueue: EnqueueSystem) -> None:
        self.r = resources
        self.execution_snapshot = execution_snapshot
        self.enqueue = enqueue
        self.wp = resources.repo.waitpoints
        # Concurrent completions (API calls, timeouts, finished children) share one UPDATE and
        # one look-up of the runs they unblock.
        self._completions: Batcher[Completion, bool] = Batcher(self._complete_batch)
        # Concurrent blocks (the waits of many runs) share one statement per step and one Redis
        # call per kind; a run's error is its own outcome, never the batch's.
        self._blocks: Batcher[BlockCall, BlockOutcome | Exception] = Batcher(self._block_batch, max_batch=100)
        # The waitpoints a wait names and the journals restored runs replay, for many runs at once
        self._gets: Batcher[str, Waitpoint | None] = Batcher(self._get_batch, max_batch=500)
        self._creates: Batcher[NewWaitpoint, Waitpoint] = Batcher(self._create_batch, max_batch=500)
        self._journals: Batcher[tuple[str, int], JournalPage] = Batcher(self._journal_batch, max_batch=200)

    def _at(self, seconds_from_now: float) -> datetime:
        return datetime.fromtimestamp(self.r.clock.now() + seconds_from_now, UTC)

    async def get(self, waitpoint_id: str, env_id: str | None = None) -> Waitpoint | None:
        """A waitpoint (with ``env_id``: only one of that environment); concurrent look-ups share
        one query."""
        wp = await self._gets.submit(waitpoint_id)
        return wp if wp is not None and env_id in (None, wp.env_id) else None

    async def _journal_batch(self, wanted: list[tuple[str, int]]) -> list[JournalPage]:
        return await self.wp.journals(wanted)

    async def _get_batch(self, ids: list[str]) -> list[Waitpoint | None]:
        found = await self.wp.get_many(ids)
        return [found.get(i) for i in ids]

    # --- creating -----------------------------------------------------------------------------

    async def _create(self, wp: NewWaitpoint, now: datetime | None = None) -> tuple[Waitpoint, bool]:
        """Insert ``wp`` (see WaitpointRepository.create); without an idempotency key, concurrent
        creations share one insert."""
        if wp.idempotency_key is None:
            return await self._creates.submit(wp), False
        return await self.wp.create(wp, now)

    async def _create_batch(self, wps: list[NewWaitpoint]) -> list[Waitpoint]:
        return await self.wp.create_many(wps)

    async def create_token(self, env_id: str, *, idempotency_key: str | None = None,
                           idempotency_key_ttl_s: float | None = None, timeout_s: float | None = None,
                           tags: Sequence[str] = ()) -> tuple[Waitpoint, bool]:
        """A MANUAL waitpoint; the same idempotency key returns the same token until the key's TTL
        (default 30 days) passes. A timeout completes it with an error output."""
        ttl_s = 30 * 86400 if idempotency_key_ttl_s is None else idempotency_key_ttl_s  # 0: expired at once
        wp, cached = await self._create(NewWaitpoint(
            id=new_id("waitpoint"), env_id=env_id, type="MANUAL", idempotency_key=idempotency_key,
            idempotency_key_expires_at=self._at(ttl_s) if idempotency_key else None,
            timeout_at=self._at(timeout_s) if timeout_s is not None else None, tags=tuple(tags)), self._at(0))
        _same_kind(wp, "MANUAL", idempotency_key)
        # a repeat (same key) schedules the job too: the first call may have stored the token and
        # failed on the way to Redis; the job's fixed id makes it the same job
        if wp.status == "PENDING" and wp.timeout_at is not None:
            await self.r.change_jobs(
                schedule=[engine_jobs.waitpoint_timeout(wp.id, wp.env_id, wp.timeout_at.timestamp())])
        return wp, cached

    async def create_datetime(self, env_id: str, at: datetime, *, idempotency_key: str | None = None) -> Waitpoint:
        """A DATETIME waitpoint, completed by an engine job at ``at``."""
        wp, cached = await self._create(NewWaitpoint(
            id=new_id("waitpoint"), env_id=env_id, type="DATETIME", completed_after=at,
            idempotency_key=idempotency_key,
            idempotency_key_expires_at=_day_after(at) if idempotency_key else None), self._at(0))
        _same_kind(wp, "DATETIME", idempotency_key)
        if wp.status == "PENDING" and wp.completed_after is not None:  # a repeat too (see create_token)
            await self.r.change_jobs(
                schedule=[engine_jobs.waitpoint_datetime(wp.id, wp.env_id, wp.completed_after.timestamp())])
        return wp

    # --- completing ---------------------------------------------------------------------------

    async def complete(self, waitpoint_id: str, output: Any = None, *, is_error: bool = False,
                       env_id: str | None = None) -> bool:
        """Complete one waitpoint; False when it was already complete (the first output stays).
        With ``env_id``, only a token of that environment (False for anything else)."""
        return await self._completions.submit(Completion(output, is_error, id=waitpoint_id, env_id=env_id))

    async def _complete_batch(self, completions: list[Completion]) -> list[bool]:
        """Concurrent :meth:`complete` calls, together: one completion statement, one query for
        the blocked runs, one continuation statement, one queue call and one jobs call. Of two
        completions of one token here, the first caller's is applied, and only it hears True."""
        won = {ord_ for _, _, ord_ in await self._complete(completions, cancel_timeouts=True)}
        return [i in won for i in range(len(completions))]

    async def complete_many(self, completions: Sequence[Completion], *, cancel_timeouts: bool = False) -> list[str]:
        """Complete waitpoints, then continue every run whose last blocking waitpoint that was;
        each run is continued once however many of its waitpoints completed here. With
        ``cancel_timeouts``, the timeout and date jobs of the waitpoints completed are cancelled
        (only of those that have one: a token without a timeout costs no jobs call)."""
        return [w for w, _, _ in await self._complete(completions, cancel_timeouts=cancel_timeouts)]

    async def _complete(self, completions: Sequence[Completion], *,
                        cancel_timeouts: bool) -> list[tuple[str, bool, int]]:
        """:meth:`complete_many`: (id, timed, position) of the waitpoints completed."""
        completed = await self.wp.complete(completions)
        done = [w for w, _, _ in completed]
        if not done:
            return completed
        # Committed: the callers are answered that their waitpoints completed whatever follows (an
        # error would make the batcher complete them again, and every one would be found done
        # already); a continuation left undone is the sweeper's, a timeout job left armed fires
        # on a completed waitpoint and does nothing.
        try:
            runs = await self.wp.blocked_runs(done, limit=self.CONTINUE_PAGE + 1)
            cancel = [job for w, timed, _ in completed if timed and cancel_timeouts
                      for job in (engine_jobs.waitpoint_timeout_id(w), engine_jobs.waitpoint_datetime_id(w))]
            if len(runs) <= self.CONTINUE_PAGE:
                await self.continue_runs(runs, cancel)
            else:
                await self._continue_later(done, cancel)
        except Exception as exc:
            log_failure(log, exc, "%d waitpoints completed; continuing the runs they blocked failed (the sweeper"
                        " will)", len(done))
        return completed

    # A completion that unblocks more runs than this continues them a page at a time in an engine
    # job of each environment's lane: thousands of runs waiting on one token must neither hold the
    # completions of every tenant that share its batch, nor block Redis with one enqueue of them all
    CONTINUE_PAGE = 200

    async def _continue_later(self, waitpoint_ids: Sequence[str], cancel: Sequence[str]) -> None:
        by_env: dict[str, list[str]] = {}
        for wp_id, env_id in (await self.wp.environments_of(waitpoint_ids)).items():
            by_env.setdefault(env_id, []).append(wp_id)
        now = self.r.clock.now()
        await self.r.change_jobs(cancel, [engine_jobs.continue_blocked(sorted(wps), "", env_id, now)
                                          for env_id, wps in by_env.items()])

    async def continue_page(self, waitpoint_ids: Sequence[str], after: str) -> str | None:
        """Continue a page of the runs blocked on ``waitpoint_ids`` (by id after ``after``); the
        id to go on after when a page was full, else None."""
        runs = await self.wp.blocked_runs(waitpoint_ids, after=after, limit=self.CONTINUE_PAGE)
        await self.continue_runs(runs)
        return runs[-1] if len(runs) == self.CONTINUE_PAGE else None

    async def on_runs_finished(self, runs: Sequence[RunRow]) -> None:
        """Finished runs complete the waitpoints their parents (or any run) wait on: a run's RUN
        waitpoints, and (when the last child of a batch finishes) the batch's BATCH waitpoint."""
        waited = [r for r in runs if r.resume_parent_on_completion]
        if not waited:
            return
        # every run's RUN waitpoints, a batch's runs' too: another run may wait on one of them
        # (wait.for_run); a run with none costs a look-up by an index in the same statement
        completions = [
            Completion(r.output if r.status == RunStatus.COMPLETED else (r.error or {"type": r.status}),
                       r.status != RunStatus.COMPLETED, run_id=r.id)
            for r in waited
        ]
        batches = Counter(r.batch_id for r in waited if r.batch_id is not None)
        if batches:
            complete_batches = await self.wp.count_finished_children(dict(sorted(batches.items())))
            if complete_batches:
                completions += [Completion(None, id=w) for w in await self.wp.batch_waitpoints(complete_batches)]
        await self.complete_many(completions)

    async def on_datetime(self, waitpoint_id: str) -> None:
        await self.complete(waitpoint_id)

    async def on_timeout(self, waitpoint_id: str) -> None:
        await self.complete(waitpoint_id, TOKEN_TIMEOUT_ERROR, is_error=True)

    # --- blocking and continuing --------------------------------------------------------------

    async def run_waitpoint(self, env_id: str, run_id: str, waiter_id: str | None = None) -> Waitpoint:
        """The RUN waitpoint of any run of the environment, made on demand (one per run, shared by
        every waiter; nothing on the plain trigger path): completed with the run's output, or its
        error, when it finishes; at once if it has finished already.

        ``waiter_id``: the run that is to wait on it. When that is the run itself or one that
        descends from it (and it has not finished), the run would finish only after the wait,
        which would never end: a waitpoint of the waiter's own is returned instead, completed at
        once with a ``WAIT_DEADLOCK`` error (the run's shared one, other waiters', is untouched)."""
        run = await self.r.repo.runs.get_run(run_id, env_id)
        if run is None:
            raise NotFoundError("run", run_id)
        if waiter_id is not None and run.finished_at is None and await self._descends_from(waiter_id, run):
            own, _ = await self._create(NewWaitpoint(id=new_id("waitpoint"), env_id=env_id, type="RUN",
                                                     completed_by_run_id=run_id))
            await self._fail_self_wait(own.id, run_id, by_key=False)
            return await self.wp.get(own.id) or own
        key = f"run:{run_id}"
        for _ in range(3):
            wp, _ = await self._create(NewWaitpoint(id=new_id("waitpoint"), env_id=env_id, type="RUN",
                                                      completed_by_run_id=run_id, idempotency_key=key))
            if wp.type != "RUN" or wp.completed_by_run_id != run_id:  # a token took that key: one of its own
                wp, _ = await self._create(NewWaitpoint(id=new_id("waitpoint"), env_id=env_id, type="RUN",
                                                          completed_by_run_id=run_id))
            if not run.resume_parent_on_completion:
                # its finish completes RUN waitpoints from now on; one that finished in between is seen
                # below (and the sweeper completes any RUN waitpoint whose run has finished)
                await self.r.repo.runs.mark_waited_on(run_id)
            fresh = await self.r.repo.runs.get_run(run_id, env_id)
            if fresh is None or fresh.finished_at is not None or wp.status == "PENDING":
                break
            # Completed, by a run not finished: the run was reopened since (redriven from the DLQ)
            # and this is the end of its earlier life. The key is let go and the next waitpoint
            # waits for how the run ends now (waiters that took this one keep its outcome).
            await self.wp.release_run_key(wp.id, key)
        if fresh is not None and fresh.finished_at is not None and wp.status == "PENDING":
            ok = fresh.status == RunStatus.COMPLETED
            await self.complete_many([Completion(fresh.output if ok else (fresh.error or {"type": fresh.status}),
                                                 not ok, id=wp.id)])
        return wp

    async def block(self, run_id: str, snapshot_id: str, *, sequence: int, kind: str, key: str,
                    waitpoint_ids: Sequence[str], result: Any = None, suspend: bool = False,
                    env_id: str | None = None) -> BlockOutcome:
        """Journal the wait at ``sequence`` and block the executing run on ``waitpoint_ids``;
        with ``suspend``, checkpoint it too if it is blocked (one request instead of a wait, a
        poll and a suspend: what a supervisor asks for when runs queue for its slots). With
        ``env_id``, the one waitpoint must be of that environment (else :class:`NotFoundError`)
        and the entry's key is the waitpoint's, not ``key``: the same statement looks it up.
        Concurrent blocks of many runs share their statements and Redis calls (see
        :meth:`_block_many`). No run lock: the statement's compare-and-set on the run's snapshot
        decides, as for a dequeue or a completion (a racing cancel or timeout loses, or wins and
        the block writes nothing)."""
        if env_id is not None and len(waitpoint_ids) != 1:
            raise ValueError("block: a wait looked up by environment names one waitpoint")
        outcome = await self._blocks.submit(
            BlockCall(run_id, snapshot_id, sequence, kind, key, tuple(waitpoint_ids), result, suspend, env_id))
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def _block_batch(self, calls: list[BlockCall]) -> list[BlockOutcome | Exception]:
        """Concurrent :meth:`block` calls, blocked together. A run named twice (a repeated
        request) is blocked once, then again after: its second call finds the run moved on."""
        seen: set[str] = set()
        first: list[int] = []
        again: list[int] = []
        for i, c in enumerate(calls):
            (again if c.run_id in seen else first).append(i)
            seen.add(c.run_id)
        out: list[BlockOutcome | Exception | None] = [None] * len(calls)
        for i, outcome in zip(first, await self._block_many([calls[i] for i in first]), strict=True):
            out[i] = outcome
        if again:
            for i, outcome in zip(again, await self._block_batch([calls[i] for i in again]), strict=True):
                out[i] = outcome
        return [o if o is not None else RuntimeError("block not done") for o in out]

    async def _block_many(self, calls: Sequence[BlockCall]) -> list[BlockOutcome | Exception]:
        """Block runs (each once): one statement journals and blocks them all (and
        suspends those asked to: one commit), then one query counts their pending waitpoints again
        (a completion committed meanwhile did not see their blocking rows), one jobs call re-arms
        timeouts, one queue call frees the suspended runs' slots, and one continuation moves on
        those found with nothing pending. Each call's outcome, or the error that refused it
        (stale snapshot, duplicate execution...)."""
        written = await self.wp.block_executing([
            BlockWrite(c.run_id, c.snapshot_id, JournalEntry(c.sequence, c.kind, c.key, c.result, c.waitpoint_ids[0]),
                       c.waitpoint_ids, new_id("snapshot"), f"Waiting ({c.kind} {c.key})",
                       (new_id("checkpoint"), new_id("snapshot")) if c.suspend else None, c.env_id)
            for c in calls])
        out: list[BlockOutcome | Exception | None] = [None] * len(calls)
        blocked: list[int] = []
        over: list[int] = []
        for i, (c, done) in enumerate(zip(calls, written, strict=True)):
            t = done.transition
            if done.missing:
                out[i] = NotFoundError("waitpoint", c.waitpoint_ids[0])
            elif t.latest_snapshot_id is None:
                out[i] = NotFoundError("run", c.run_id)
            elif t.latest_snapshot_id != c.snapshot_id and not t.applied:
                out[i] = StaleSnapshotError(c.run_id, c.snapshot_id, t.latest_snapshot_id, str(t.latest_status))
            elif t.latest_status != E.EXECUTING and not t.applied:
                out[i] = InvalidTransitionError(c.run_id, str(t.latest_status), "block")
            elif not done.allowed:
                out[i] = DuplicateExecutionError(c.run_id, c.sequence)
            elif t.applied:
                blocked.append(i)
            else:  # nothing pending any more: the run goes on at once
                over.append(i)
        # Committed: from here on nothing may fail the batch (the batcher would run it again and
        # every run would find itself moved on). Each step is best-effort; what one leaves undone
        # is repaired as after a crash here (the sweeper continues a WAITING run that nothing
        # blocks, the reconciler frees a suspended run's slot, a heartbeat re-arms its job).
        counts: dict[str, int] = {}
        try:
            counts = await self.wp.pending_counts([calls[i].run_id for i in blocked])
        except Exception:
            log.warning("block: could not count the pending waitpoints again; the sweeper will", exc_info=True)
        cancel: list[str] = []
        schedule: list[engine_jobs.JobSpec] = []
        acks: list[tuple[str, str, str]] = []
        ready: list[int] = []
        for i in blocked:
            t, suspended = written[i].transition, written[i].suspended
            assert t.snapshot is not None and t.run is not None
            latest = suspended or t.snapshot
            off, on = self.execution_snapshot.rearm(calls[i].snapshot_id, E.EXECUTING, latest)
            cancel += off
            schedule += on
            if suspended is not None:
                cancel.append(engine_jobs.max_duration_id(t.run.id, t.run.attempt_number))
                acks.append((t.run.env_id, t.run.id, t.run.worker_group_id))
            out[i] = BlockOutcome(True, latest, suspended=suspended is not None)
            if counts.get(calls[i].run_id) == 0:
                ready.append(i)
        # held only: a continuation that enqueued a suspended run again meanwhile keeps its message
        await self.r.after_commit("block", self.r.change_jobs(cancel, schedule),
                                  *([self.r.ack_many(acks, held_only=True)] if acks else []))
        for i in blocked:
            t, suspended = written[i].transition, written[i].suspended
            assert t.snapshot is not None and t.run is not None
            self.r.events.emit(RunEvent("run_blocked", t.run.id, t.run.env_id, t.snapshot.id,
                                        attempt=t.run.attempt_number))
            if suspended is not None:
                self.r.events.emit(RunEvent("run_suspended", t.run.id, t.run.env_id, suspended.id,
                                            {"checkpoint": suspended.checkpoint_id}, attempt=t.run.attempt_number))
        continued: dict[str, Snapshot] = {}
        if ready:
            try:
                continued = await self.continue_runs([calls[i].run_id for i in ready])
            except Exception:
                log.warning("block: could not continue runs whose wait completed; the sweeper will", exc_info=True)
        for i in ready:
            c = calls[i]
            if c.run_id not in continued:
                continue
            if written[i].suspended is not None:  # queued to be restored: the executor stops all the same
                out[i] = BlockOutcome(True, continued[c.run_id], suspended=True)
            else:
                out[i] = await self._over(c, continued[c.run_id])
        for i in over:
            out[i] = await self._over(calls[i])
        return [o if o is not None else RuntimeError("block not done") for o in out]

    async def _over(self, call: BlockCall, continued: Snapshot | None = None) -> BlockOutcome | Exception:
        """A wait that is over at once (its waitpoints completed): the run's snapshot and the
        resolved entry; a failure is this call's own outcome. (The block wrote no blocking rows
        then; rows of the run are another wait's, written before its own transition.)"""
        try:
            return BlockOutcome(False, continued or await self.execution_snapshot.latest(call.run_id),
                                await self.resolved_entry(call.run_id, call.sequence))
        except Exception as exc:
            return exc

    async def _then_suspend(self, run_id: str, outcome: BlockOutcome) -> BlockOutcome:
        """A blocked run suspended at once, under the lock its block took. Should the run have
        moved on meanwhile (a cancel takes no lock), the outcome stays as it was and the caller
        finds out as it would after a plain block."""
        if not outcome.blocked:
            return outcome
        try:
            snapshot = await self.suspend(run_id, outcome.snapshot.id)
        except (StaleSnapshotError, InvalidTransitionError):
            return outcome
        return BlockOutcome(True, snapshot, suspended=True)

    async def _blocked(self, run_id: str, snapshot_id: str, sequence: int, what: str, pending: int) -> BlockOutcome:
        """The blocking rows are written (caller holds the lock): move the run to
        EXECUTING_WITH_WAITPOINTS, unless nothing is pending any more."""
        if pending == 0:
            await self.wp.unblock(run_id)
            return BlockOutcome(False, await self.execution_snapshot.latest(run_id),
                                await self.resolved_entry(run_id, sequence))
        result = await self.execution_snapshot.apply(
            run_id, E.EXECUTING_WITH_WAITPOINTS, RunStatus.WAITING, from_statuses=(E.EXECUTING,),
            expected_snapshot_id=snapshot_id, operation="block", description=f"Waiting ({what})")
        return await self._after_block(run_id, snapshot_id, sequence, result)

    async def _after_block(self, run_id: str, snapshot_id: str, sequence: int,
                           result: TransitionResult) -> BlockOutcome:
        """The run is EXECUTING_WITH_WAITPOINTS (caller holds the lock): re-arm its timeout and
        continue it at once if what it waits on completed before its blocking rows committed."""
        assert result.snapshot is not None and result.run is not None
        await self.execution_snapshot.after_transition(snapshot_id, E.EXECUTING, result.snapshot)
        self.r.events.emit(RunEvent("run_blocked", run_id, result.run.env_id, result.snapshot.id,
                                    attempt=result.run.attempt_number))
        # A completion that committed before our blocking rows did found nobody to continue.
        try:
            if await self.wp.pending_count(run_id) == 0:
                continued = await self.try_continue(run_id)
                if continued is not None:
                    return BlockOutcome(False, continued, await self.resolved_entry(run_id, sequence))
        except Exception:  # blocked all the same: the sweeper continues a run nothing blocks
            log.warning("run %s blocked; the check for a wait already over failed (the sweeper will)", run_id,
                        exc_info=True)
        return BlockOutcome(True, result.snapshot)

    async def _executing(self, run_id: str, snapshot_id: str, operation: str) -> Snapshot:
        latest = await self.execution_snapshot.latest(run_id)
        if latest.id != snapshot_id:
            raise StaleSnapshotError(run_id, snapshot_id, latest.id, latest.engine_status)
        if latest.engine_status != E.EXECUTING:
            raise InvalidTransitionError(run_id, latest.engine_status, operation)
        return latest

    async def try_continue(self, run_id: str) -> Snapshot | None:
        """Continue a blocked run if nothing blocks it any more (idempotent); its new snapshot."""
        return (await self.continue_runs([run_id])).get(run_id)

    async def continue_runs(self, run_ids: Iterable[str], cancel_jobs: Sequence[str] = ()) -> dict[str, Snapshot]:
        """Continue every run of ``run_ids`` that is blocked and that nothing blocks any more
        (idempotent): run id -> new snapshot of those continued. No run lock: one statement
        decides and writes each run's continuation by compare-and-set (see
        ``WaitpointRepository.continue_blocked``); a run whose place was taken by another writer
        (a suspend, a cancel) is looked at again. Then one queue call restores the suspended ones
        and one jobs call (with ``cancel_jobs``) re-arms the timeouts of those still executing.
        Dying in between: the reconciler finds a QUEUED_EXECUTING run missing from the queue."""
        every = sorted(set(run_ids))
        out: dict[str, Snapshot] = {}
        for start in range(0, max(len(every), 1), self.CONTINUE_PAGE):  # one statement, one enqueue a page
            out.update(await self._continue_page(every[start:start + self.CONTINUE_PAGE], cancel_jobs))
            cancel_jobs = ()
        return out

    async def _continue_page(self, todo: list[str], cancel_jobs: Sequence[str]) -> dict[str, Snapshot]:
        done: list[TransitionResult] = []
        for _ in range(5):
            if not todo:
                break
            results = await self.wp.continue_blocked([(run_id, new_id("snapshot")) for run_id in todo])
            done += [r for r, _ in results if r.applied]
            todo = [r.run_id for r, conflict in results if conflict]
        cancel, schedule, restore = list(cancel_jobs), [], []
        for result in done:
            assert result.run is not None and result.snapshot is not None
            if result.snapshot.engine_status == E.EXECUTING:  # still in its executor
                c, s = self.execution_snapshot.rearm(result.snapshot.previous_snapshot_id,
                                                     E.EXECUTING_WITH_WAITPOINTS, result.snapshot)
                cancel += c
                schedule += s
            else:  # suspended: queued to be restored
                restore.append(self.enqueue.item_for(result.run, reset_deliveries=True))
        await self.r.after_commit("continue", self.r.change_jobs(cancel, schedule),
                                  *([self.r.enqueue_items(restore)] if restore else []))
        out = {}
        for result in done:
            assert result.run is not None and result.snapshot is not None
            self.r.events.emit(RunEvent("run_continued", result.run_id, result.run.env_id, result.snapshot.id,
                                        {"status": result.snapshot.engine_status}, attempt=result.run.attempt_number))
            out[result.run_id] = result.snapshot
        return out

    async def suspend(self, run_id: str, snapshot_id: str) -> Snapshot:
        """Checkpoint a blocked run: REPLAY checkpoint at the journal position, SUSPENDED,
        concurrency released. A stale ``snapshot_id`` (the run moved on) is refused."""
        async with self.r.locker.lock("suspend", run_id):
            (outcome,) = await self._suspend_held([(run_id, snapshot_id, snapshot_id, E.EXECUTING_WITH_WAITPOINTS)])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def _suspend_held(self, runs: Sequence[tuple[str, str, str, str]]) -> list[Snapshot | Exception]:
        """Suspend blocked runs whose locks the caller holds, each (run id, its
        EXECUTING_WITH_WAITPOINTS snapshot id, the snapshot whose heartbeat job is armed and its
        status): one statement, one jobs call and one queue call (their concurrency released);
        those found with nothing pending any more continue (restored through the queue). Per run,
        its latest snapshot, or the error that refused it (the run moved on)."""
        if not runs:
            return []
        checkpoints = [new_id("checkpoint") for _ in runs]
        results = await self.wp.suspend([(run_id, expected, cp, new_id("snapshot"))
                                         for (run_id, expected, _, _), cp in zip(runs, checkpoints, strict=True)])
        out: list[Snapshot | Exception] = []
        cancel: list[str] = []
        schedule: list[engine_jobs.JobSpec] = []
        acks: list[tuple[str, str, str]] = []
        ready: list[str] = []
        for (run_id, expected, armed, armed_status), (result, pending) in zip(runs, results, strict=True):
            try:
                self.execution_snapshot.raise_unless_applied(result, expected, "suspend")
            except Exception as exc:
                out.append(exc)
                continue
            run, snapshot = result.run, result.snapshot
            assert run is not None and snapshot is not None
            c, s = self.execution_snapshot.rearm(armed, armed_status, snapshot)
            cancel += [*c, engine_jobs.max_duration_id(run.id, run.attempt_number)]
            schedule += s
            acks.append((run.env_id, run.id, run.worker_group_id))
            out.append(snapshot)
            if pending == 0:
                ready.append(run_id)
        await self.r.after_commit("suspend", self.r.change_jobs(cancel, schedule),
                                  *([self.r.ack_many(acks, held_only=True)] if acks else []))
        for (run_id, _, _, _), (result, _), cp in zip(runs, results, checkpoints, strict=True):
            if result.applied:
                assert result.run is not None and result.snapshot is not None
                self.r.events.emit(RunEvent("run_suspended", run_id, result.run.env_id, result.snapshot.id,
                                            {"checkpoint": cp}, attempt=result.run.attempt_number))
        continued: dict[str, Snapshot] = {}
        if ready:
            try:
                continued = await self.continue_runs(ready)
            except Exception:  # suspended all the same: the sweeper continues a run nothing blocks
                log.warning("suspend: could not continue runs whose wait completed; the sweeper will", exc_info=True)
        return [continued.get(run_id, o) if isinstance(o, Snapshot) else o
                for (run_id, _, _, _), o in zip(runs, out, strict=True)]

    # --- child runs ---------------------------------------------------------------------------

    async def trigger_and_wait(self, parent: RunRow, snapshot_id: str, sequence: int,
                               requests: Sequence[Any], *, batch: bool,
                               suspend: bool = False) -> tuple[list[str], BlockOutcome]:
        """Create child runs and block ``parent`` on them (a RUN waitpoint, or one BATCH waitpoint
        for a batch), journaled at ``sequence``. A replay of the same call re-blocks on the
        children it created the first time instead of creating new ones. ``suspend``: as for
        :meth:`block`."""
        journal = {e.sequence: e for e in (await self.wp.journal(parent.id, sequence)).entries}
        kind = "batch" if batch else "child"
        existing = journal.get(sequence)
        if existing is not None:
            if existing.kind != kind or existing.waitpoint_id is None:
                raise DuplicateExecutionError(parent.id, sequence)
            run_ids, key, result = existing.result[RUN_IDS], existing.key, existing.result
            if existing.waitpoint_status == "PENDING" and len(run_ids) == len(requests):
                created = await self._create_missing_children(parent, snapshot_id, sequence, kind,
                                                              existing.waitpoint_id, run_ids, key, requests,
                                                              key if batch else None)
                if created != (run_ids, key):  # a child's key named an existing run: waited on instead
                    (run_ids, key), result = created, {RUN_IDS: created[0]}
                if batch:  # runs an item's key named, the call before (which failed after naming them)
                    await self._block_on_joined(parent, run_ids, key)
                elif key in await self._ancestry(parent):  # the call before failed before failing the wait
                    await self._fail_self_wait(existing.waitpoint_id, key)
            return run_ids, await self.block(parent.id, snapshot_id, sequence=sequence, kind=kind,
                                             key=key, waitpoint_ids=[existing.waitpoint_id],
                                             result=result, suspend=suspend)
        async with self.r.locker.lock("trigger_and_wait", parent.id):
            await self._executing(parent.id, snapshot_id, "trigger and wait from")
            run_ids = [new_id("run") for _ in requests]
            batch_id: str | None = None
            if batch:
                batch_id = new_id("batch")
                await self.r.repo.waitpoints.insert_batch(batch_id, parent.env_id, len(requests), parent.id)
                wp, _ = await self._create(NewWaitpoint(
                    id=new_id("waitpoint"), env_id=parent.env_id, type="BATCH",
                    completed_by_batch_id=batch_id))
                key = batch_id
            else:
                wp, _ = await self._create(NewWaitpoint(
                    id=new_id("waitpoint"), env_id=parent.env_id, type="RUN",
                    completed_by_run_id=run_ids[0]))
                key = run_ids[0]
            # Journal and blocking rows first: should the children's creation fail part-way, the
            # sweeper finds the batch short of runs and fails the wait instead of leaving it hanging.
            existing_entry, pending = await self.wp.block(
                parent.id, [wp.id], JournalEntry(sequence, kind, key, {RUN_IDS: run_ids}, wp.id))
            if existing_entry is not None:
                raise DuplicateExecutionError(parent.id, sequence)
            function = "batchTriggerAndWait" if batch else "triggerAndWait"
            try:
                triggered = await self.enqueue.trigger_many([
                    dataclasses.replace(req, run_id=rid, batch_id=batch_id or req.batch_id,
                                        resume_parent_on_completion=True, trigger_function=function)
                    for req, rid in zip(requests, run_ids, strict=True)])
            except Exception as exc:
                if not isinstance(exc, CHILDREN_REFUSED):
                    # A failure of the moment (PostgreSQL or Redis away, a lock not had in time, a
                    # process going down): the same call again (the supervisor repeats it, or the
                    # attempt's replay makes it) creates the children still missing; the sweeper
                    # fails the wait if nobody does within the grace period.
                    raise
                # The children are refused (bad input, a full queue): fail the wait now, so that
                # the parent (retried or replayed) gets the error instead of waiting for ever.
                # (the parent is not blocked yet and this task holds its lock: complete, do not continue)
                await self.wp.complete([Completion({"type": "CHILD_TRIGGER_FAILED", "message":
                                                    f"the child run(s) could not be created: {exc}"},
                                                   True, id=wp.id)])
                raise
            taken = {rid: t for rid, t in zip(run_ids, triggered, strict=True) if t.is_cached}
            if taken:
                run_ids, key = await self._wait_on_existing(parent, sequence, kind, wp.id, run_ids, key,
                                                            taken, batch_id)
                pending = await self.wp.pending_count(parent.id)
            outcome = await self._blocked(parent.id, snapshot_id, sequence, f"{kind} {key}", pending)
            return run_ids, await self._then_suspend(parent.id, outcome) if suspend else outcome

    async def _create_missing_children(self, parent: RunRow, snapshot_id: str, sequence: int, kind: str,
                                       waitpoint_id: str, run_ids: list[str], key: str, requests: Sequence[Any],
                                       batch_id: str | None) -> tuple[list[str], str]:
        """A journaled trigger whose children were not all created (the first call failed part-way,
        e.g. PostgreSQL went away): create the missing ones, with the ids the journal recorded. A
        child whose idempotency key names an existing run is waited on as the first call would
        have (:meth:`_wait_on_existing`). The run ids and key the journal names after.

        Under the parent's lock, only while the parent still executes this snapshot (a parent
        cancelled or finished since gets no children) and its wait is still pending (the sweeper,
        which takes the same lock, may have failed it as never created)."""
        async with self.r.locker.lock("trigger_and_wait", parent.id):
            await self._executing(parent.id, snapshot_id, "trigger and wait from")
            have = await self.wp.existing_runs(run_ids)
            missing = [(rid, req) for rid, req in zip(run_ids, requests, strict=True) if rid not in have]
            if not missing:
                return run_ids, key
            waitpoint = await self.wp.get(waitpoint_id)
            if waitpoint is None or waitpoint.status != "PENDING":
                return run_ids, key  # the sweeper failed the wait: the block answers with that
            function = "batchTriggerAndWait" if batch_id else "triggerAndWait"
            triggered = await self.enqueue.trigger_many([
                dataclasses.replace(req, run_id=rid, batch_id=batch_id or req.batch_id,
                                    resume_parent_on_completion=True, trigger_function=function)
                for rid, req in missing])
            taken = {rid: t for (rid, _), t in zip(missing, triggered, strict=True) if t.is_cached}
            if not taken:
                return run_ids, key
            return await self._wait_on_existing(parent, sequence, kind, waitpoint_id, run_ids, key, taken, batch_id)

    async def _wait_on_existing(self, parent: RunRow, sequence: int, kind: str, waitpoint_id: str,
                                run_ids: list[str], key: str, taken: dict[str, Any],
                                batch_id: str | None) -> tuple[list[str], str]:
        """Children whose idempotency key returned an existing run: the parent waits on that run.
        The journal and (for a single child) the RUN waitpoint name it; if it has finished already
        the waitpoint completes now, else the run's finish or the sweeper completes it. In a
        batch, the parent also waits on each such run's RUN waitpoint: the batch completes with
        the runs it created, and must not give the parent results of runs still going."""
        parent_id = parent.id
        run_ids = [taken[rid].id if rid in taken else rid for rid in run_ids]
        # a key that names the parent itself or a run it descends from: waiting on it would wait
        # for ever (that run finishes only after this wait)
        ancestry = await self._ancestry(parent)
        if batch_id is None:
            key = run_ids[0]
            await self.wp.repoint(parent_id, sequence, waitpoint_id, key, {RUN_IDS: run_ids})
            if key in ancestry:
                await self._fail_self_wait(waitpoint_id, key)
                return run_ids, key
            holder = await self.r.repo.runs.get_run(key)
            if holder is not None and holder.finished_at is not None:  # the parent is not blocked yet
                failed = holder.status != RunStatus.COMPLETED
                await self.wp.complete([Completion((holder.error or {"type": holder.status}) if failed
                                                   else holder.output, failed, id=waitpoint_id)])
        else:  # the batch completes with the runs it created; results come from the runs named here
            await self.wp.repoint(parent_id, sequence, None, key, {RUN_IDS: run_ids},
                                  batch_shrink=(batch_id, len(taken)))
            # its runs that finished before it shrank were counted against its size then, short of
            # it: counted again now, the batch completes if they are all there
            if await self.wp.count_finished_children({batch_id: 0}):
                await self.complete_many([Completion(None, id=w) for w in await self.wp.batch_waitpoints([batch_id])])
            held = sorted({t.id for t in taken.values()} - ancestry)  # (an ancestor's item: its state then)
            joined = [await self.run_waitpoint(parent.env_id, run_id) for run_id in held]
            await self.wp.block(parent_id, [w.id for w in joined], None)
        return run_ids, key

    async def _fail_self_wait(self, waitpoint_id: str, key: str, *, by_key: bool = True) -> None:
        """A wait on run ``key``, which the waiting run is or descends from: that run finishes only
        after this wait, which ends at once instead, with an error (the waiter is not blocked yet,
        or a repeat re-blocks). ``by_key``: a child's idempotency key named it (trigger and wait);
        else the run was waited on by its id (``wait.for_run``)."""
        why = (f"the idempotency key names run {key}, which this run is or descends from" if by_key
               else f"run {key} is this run or one it descends from, and finishes only after this wait")
        await self.wp.complete([Completion({"type": "CHILD_TRIGGER_FAILED" if by_key else "WAIT_DEADLOCK",
                                            "message": f"{why}: a run cannot wait on itself"}, True, id=waitpoint_id)])

    async def _block_on_joined(self, parent: RunRow, run_ids: list[str], batch_id: str) -> None:
        """The parent of a batch also waits on each run the batch's items named by key rather than
        made (:meth:`_wait_on_existing`); again on a repeated call, as the first may have failed
        after naming them in the journal and before blocking on them (idempotent)."""
        outside = await self.wp.runs_outside_batch(run_ids, batch_id)
        if not outside:
            return
        held = sorted(set(outside) - await self._ancestry(parent))
        joined = [await self.run_waitpoint(parent.env_id, run_id) for run_id in held]
        if joined:
            await self.wp.block(parent.id, [w.id for w in joined], None)

    async def _descends_from(self, run_id: str, ancestor: RunRow) -> bool:
        """Whether run ``run_id`` is ``ancestor``, or descends from it through runs each waited on
        by its parent (trigger and wait): then ``ancestor`` finishes only after it. A child
        triggered with a parent that did not wait for it (``resume_parent_on_completion`` false)
        breaks the chain: that parent may finish first, and a wait on it is no deadlock. A run of
        another tree, or not below it, costs one look-up by key (a run's root and depth say where
        it may be); the chain is read only between the two (ANCESTRY_READ_MOST up)."""
        if run_id == ancestor.id:
            return True
        run = await self.r.repo.runs.get_run(run_id, light=True)
        if run is None or run.root_run_id != (ancestor.root_run_id or ancestor.id) or run.depth <= ancestor.depth:
            return False
        for _ in range(min(run.depth - ancestor.depth, ANCESTRY_READ_MOST)):
            if not run.resume_parent_on_completion or run.parent_run_id is None:
                return False
            if run.parent_run_id == ancestor.id:
                return True
            above = await self.r.repo.runs.get_run(run.parent_run_id, light=True)
            if above is None:
                return False
            run = above
        return False

    async def _ancestry(self, run: RunRow, most: int = ANCESTRY_READ_MOST) -> set[str]:
        """The run's id and those of the runs it descends from (parent, its parent...), ``most``
        of them at most (the last one's row is not read)."""
        out = {run.id}
        parent_id = run.parent_run_id
        while parent_id is not None and parent_id not in out and len(out) <= most:
            out.add(parent_id)
            if len(out) > most:
                break
            above = await self.r.repo.runs.get_run(parent_id, light=True)
            parent_id = above.parent_run_id if above is not None else None
        return out

    # --- the journal --------------------------------------------------------------------------

    async def append_journal(self, run_id: str, snapshot_id: str, sequence: int, kind: str, key: str,
                             result: Any) -> None:
        """Journal a step's result; a second execution of the same step loses the insert race."""
        latest = await self.execution_snapshot.latest(run_id)
        if latest.id != snapshot_id:
            raise StaleSnapshotError(run_id, snapshot_id, latest.id, latest.engine_status)
        if latest.engine_status not in EXECUTING:
            # A step is journaled by an execution of the run only: the snapshot a completion
            # answered (QUEUED for a retry, FINISHED) is held by none, and an entry written then
            # would be replayed by the next attempt as a step it had taken.
            raise InvalidTransitionError(run_id, latest.engine_status, "journal a step of")
        existing = await self.wp.append_journal(run_id, JournalEntry(sequence, kind, key, result, None))
        if existing is not None:
            raise DuplicateExecutionError(run_id, sequence)

    async def resolved_journal(self, run_id: str, from_sequence: int = 0) -> ResolvedJournal:
        """A page of the run's journal from ``from_sequence``, each wait's outcome filled in
        (``resolved`` False while pending), and where the next page starts (None: no more)."""
        return await self.resolve_journal(run_id, await self._journals.submit((run_id, from_sequence)))

    async def resolve_journal(self, run_id: str, page: JournalPage) -> ResolvedJournal:
        """Journal entries (with their waitpoints' state) as a replay reads them: each wait's
        outcome filled in, ``resolved`` False while it is pending. A batch wait's results (up to
        RESULTS_BYTES of its runs' outputs) end the page: it holds one at most, beside entries
        within JOURNAL_PAGE_BYTES."""
        entries, following = page.entries, page.next
        for i, e in enumerate(entries):
            if e.kind == "batch" and _done(e):
                if i > 0:  # on the next page, alone
                    entries, following = entries[:i], e.sequence
                elif i + 1 < len(entries):
                    entries, following = entries[:1], entries[1].sequence
                break
        batches = [batch_runs(e.result) for e in entries if e.kind == "batch" and _done(e)]
        runs, over = await self.wp.run_results(run_id, batches, RESULTS_BYTES) if batches else ({}, set())
        # the outcomes of the runs that waits on a waitpoint gone stood for (see _gone), each its own
        gone = [[e.key] for e in entries if _gone(e) and e.kind in ("token", "child")]
        outcomes = (await self.wp.run_results(run_id, gone, RESULTS_BYTES))[0] if gone else {}
        out = []
        for e in entries:
            item: dict[str, Any] = {"sequence": e.sequence, "kind": e.kind, "key": e.key}
            output, is_error = e.waitpoint_output, e.waitpoint_output_is_error
            if _gone(e) and e.kind in ("token", "child"):
                status, run_output, run_error = outcomes.get(e.key, (None, None, None))
                if status in FINAL_RUN_STATUSES:  # the run it stood for, finished: its outcome, as completed
                    ok = status == RunStatus.COMPLETED
                    output, is_error = (run_output if ok else (run_error or {"type": status})), not ok
                else:
                    output, is_error = {"type": "WAITPOINT_DELETED", "message": (
                        f"the waitpoint {e.waitpoint_id} of this wait was deleted by retention, and with it "
                        "its outcome")}, True
            if e.kind == "step":
                item.update(resolved=True, result=e.result)
            elif not _done(e):
                item.update(resolved=False, waitpointId=e.waitpoint_id)
            elif e.kind == "wait":
                item.update(resolved=True, result=None)
            elif e.kind == "token":
                item.update(resolved=True, result=(
                    {"ok": False, "error": output} if is_error else {"ok": True, "output": output}))
            elif e.kind == "child":
                item.update(resolved=True, result=(
                    {"ok": False, "id": e.key, "error": output} if is_error
                    else {"ok": True, "id": e.key, "output": output}))
            else:  # batch
                item.update(resolved=True, result=[
                    {"ok": False, "id": rid, "error": {
                        "type": "RESULT_TOO_LARGE", "message": "this child's result is not replayed: the results "
                        f"of its batch pass {RESULTS_BYTES} bytes"}} if rid in over
                    else run_result(rid, *runs[rid]) if rid in runs
                    else {"ok": False, "id": rid, "error": {"type": "RUN_NOT_CREATED",
                                                             "message": "the batch item's run was never created"}}
                    for rid in batch_runs(e.result)])
            out.append(item)
        return ResolvedJournal(out, following)

    async def resolved_entry(self, run_id: str, sequence: int) -> dict[str, Any] | None:
        entries = (await self.resolved_journal(run_id, sequence)).entries
        return entries[0] if entries and entries[0]["sequence"] == sequence else None

    # --- the sweeper --------------------------------------------------------------------------

    async def sweep(self, grace_s: float = 30.0, cursors: SweepCursors | None = None,
                    ) -> tuple[dict[str, int], SweepCursors]:
        """Repair what a crash between two writes left behind: RUN waitpoints of finished runs,
        batches whose children all finished (or were never all created), blocked runs that
        nothing blocks any more. Runs every few seconds as an engine job, each pass a slice of the
        waiting runs and RUN waitpoints from ``cursors`` (see WaitpointRepository.sweep_candidates);
        returns what it did and where the next pass goes on."""
        found, following = await self.wp.sweep_candidates(grace_s=grace_s, cursors=cursors or SweepCursors())
        completions = [Completion(*(
            (row["output"], False) if row["status"] == RunStatus.COMPLETED
            else (row["error"] or {"type": row["status"]}, True)), id=row["id"]) for row in found["run_waitpoints"]]
        orphans = {wp_id: Completion({"type": "CHILD_TRIGGER_FAILED", "message": "the child run was never created"},
                                     True, id=wp_id) for wp_id in found["orphaned"]}
        for row in found["batches"]:
            if row["broken"]:
                orphans[row["id"]] = Completion({"type": "BATCH_INCOMPLETE", "message":
                                                 f"only {row['created']} of the batch's {row['size']} runs were "
                                                 "created"}, True, id=row["id"])
            else:
                completions.append(Completion(None, id=row["id"]))
        done = await self.complete_many(completions)
        if orphans:
            done += await self._fail_orphans(orphans)
        await self.continue_runs(found["stuck_runs"])
        if done or found["stuck_runs"]:
            log.info("waitpoint sweep: completed %d waitpoints, checked %d blocked runs", len(done),
                     len(found["stuck_runs"]))
        return {"completed": len(done), "stuck_runs": len(found["stuck_runs"])}, following


    async def _fail_orphans(self, orphans: dict[str, Completion]) -> list[str]:
        """Fail the waits whose runs were never (all) created, under the locks of the runs they
        block, which a repeated trigger-and-wait takes to create the missing children: checked
        again there, a wait is failed or its children made, never both. A lock not had in time
        leaves its waits for the next pass."""
        done: list[str] = []
        _, blocked = await self.wp.still_orphaned(list(orphans))
        for wp_id, completion in orphans.items():
            try:
                async with self.r.locker.lock("sweep orphaned wait", *sorted(blocked.get(wp_id, ()))):
                    still, _ = await self.wp.still_orphaned([wp_id])
                    if wp_id in still:
                        done += await self.complete_many([completion])
            except LockTimeoutError:
                log.info("waitpoint sweep: the runs waiting on %s are busy; the next pass looks again", wp_id)
        return done


def _same_kind(wp: Waitpoint, kind: str, idempotency_key: str | None) -> None:
    """The waitpoint an idempotency key found is of the kind asked for: the environment's keys name
    tokens, dates and runs alike, and a token that came back as a date (resumed at that date with
    no output) or a wait that came back as a token (never resumed) is worse than a refusal."""
    if wp.type != kind:
        raise ConflictError("idempotencyKey", f"{idempotency_key!r} already names a {wp.type} waitpoint, "
                                              f"not a {kind} one")
