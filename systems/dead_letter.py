"""DeadLetterSystem: a dequeued run whose worker never started it is requeued with back-off;
past the delivery limit it goes to its environment's DLQ and fails as SYSTEM_FAILURE.
Redrive puts it back in its queue directly. After Redis lost its data the reconciler rebuilds the
DLQs from PostgreSQL (:meth:`DeadLetterSystem.rebuild`): a run is in the DLQ exactly while its
status is SYSTEM_FAILURE (the DLQ's move is the only way a run gets that status; a redrive, which
takes only such a run, takes it away)."""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from run_engine.db.runs import PAGE_BYTES, RunRow, Snapshot
from run_engine.dependencies import log_failure
from run_engine.errors import (
    InvalidTransitionError,
    LockTimeoutError,
    NotFoundError,
    StaleSnapshotError,
    ValidationError,
)
from run_engine.events import RunEvent
from run_engine.run_queue.models import DeadMessage, DlqEntry
from run_engine.statuses import FINAL_RUN_STATUSES, ExecutionStatus, RunStatus
from systems import engine_jobs
from systems.resources import SystemResources

if TYPE_CHECKING:
    from systems.enqueue import EnqueueSystem
    from systems.execution_snapshot import ExecutionSnapshotSystem
    from systems.waitpoints import WaitpointsSystem

log = logging.getLogger(__name__)
E = ExecutionStatus
DLQ_ERROR = {
    "type": "INTERNAL_ERROR",
    "code": "TASK_RUN_DEQUEUED_MAX_RETRIES",
    "message": "The run was dequeued too many times without starting",
}
#: the reason of every DLQ entry (each is a nack's past the delivery limit, lua/queue_nack.lua)
DLQ_REASON = "max deliveries reached"


@dataclass(frozen=True, slots=True)
class DeadRun:
    run: RunRow
    entry: DlqEntry


def dlq_cursor(place: str | DlqEntry | None) -> str | None:
    """The cursor of the page after ``place``, the last entry a page took or walked past:
    ``<dead at, ms>|<run id>`` (a bare run id given as the place stays one)."""
    return f"{place.dead_at_ms}|{place.run_id}" if isinstance(place, DlqEntry) else place


def parse_dlq_cursor(cursor: str | None, field: str = "page[after]") -> str | DlqEntry | None:
    """A cursor of :func:`dlq_cursor` as the entry's place; a bare run id (a cursor of engines
    before this one, or a dashboard link) as is: its place is looked up, and a page after a run no
    longer in the DLQ starts over."""
    if cursor and len(cursor) > 256:
        raise ValidationError(field, "not a cursor returned by this API")
    if not cursor or "|" not in cursor:
        return cursor or None
    ms, run_id = cursor.split("|", 1)
    if not (ms.isascii() and ms.isdigit() and len(ms) <= 15 and run_id):
        raise ValidationError(field, "not a cursor returned by this API")
    return DlqEntry(run_id, "", "", "", int(ms), 0)


class DeadLetterSystem:
    PAGE = 100
    #: the entries one page may walk past (filtered out) before it ends with a cursor to go on from
    WALK = 5000
    #: the runs one call of redrive_all puts back at most (then a cursor to go on from)
    REDRIVES = 1000
    #: the dead runs whose entries a batch of the rebuild writes (one Redis round trip)
    REBUILD_PAGE = 500

    def __init__(self, resources: SystemResources, *, execution_snapshot: ExecutionSnapshotSystem,
                 enqueue: EnqueueSystem, waitpoints: WaitpointsSystem) -> None:
        self.r = resources
        self.execution_snapshot = execution_snapshot
        self.enqueue = enqueue
        self.waitpoints = waitpoints

    async def requeue_undelivered(self, run_id: str, latest: Snapshot) -> None:
        """PENDING_EXECUTING timed out (caller holds the lock): back to the queue, or to the DLQ
        past the delivery limit. The snapshot first: a start (which takes no lock) that got in
        before it leaves this one stale and the queue untouched; a crash before the nack leaves a
        QUEUED run whose message is still handed out, which the reconciler makes ready."""
        run = await self.r.repo.runs.get_run(run_id)
        assert run is not None
        # A run being restored from a checkpoint goes back as QUEUED_EXECUTING (keeps its checkpoint).
        back_to = E.QUEUED_EXECUTING if latest.checkpoint_id else E.QUEUED
        result = await self.execution_snapshot.apply(
            run_id, back_to, RunStatus.QUEUED, from_statuses=(E.PENDING_EXECUTING,),
            expected_snapshot_id=latest.id, operation="requeue",
            description="Requeued: the attempt did not start in time",
        )
        assert result.snapshot is not None
        await self.r.change_jobs(cancel=[engine_jobs.heartbeat_id(run_id, latest.id)])
        outcome = await self.r.queue.nack(run.env_id, run_id, self.r.now_ms())
        if outcome.dead_lettered:
            # the message is in the DLQ now (nobody can dequeue it) and the caller holds the lock
            await self.finish_dead(run_id, run.env_id, (back_to,), result.snapshot.id, DLQ_ERROR, outcome.deliveries)
            return
        self.r.events.emit(RunEvent("run_requeued", run_id, run.env_id, result.snapshot.id,
                                    {"reason": "not started in time", "deliveries": outcome.deliveries},
                                    attempt=run.attempt_number))

    async def finish_dead(self, run_id: str, env_id: str, from_statuses: tuple[ExecutionStatus, ...],
                          expected_snapshot_id: str | None, error: dict[str, str], deliveries: int) -> None:
        """A run whose message went to the DLQ ends SYSTEM_FAILURE (its parent, if it waits, is
        resumed with the error)."""
        dead = await self.execution_snapshot.apply(
            run_id, E.FINISHED, RunStatus.SYSTEM_FAILURE, from_statuses=from_statuses,
            expected_snapshot_id=expected_snapshot_id, operation="dead-letter", description="Moved to the DLQ",
            set_finished=True, error=error,
        )
        assert dead.snapshot is not None and dead.run is not None
        if dead.run.resume_parent_on_completion:
            await self.waitpoints.on_runs_finished([dead.run])
        self.r.events.emit(RunEvent("run_dead_lettered", run_id, env_id, dead.snapshot.id,
                                    {"deliveries": deliveries}, attempt=dead.run.attempt_number))

    async def redrive(self, env_id: str, run_id: str) -> str:
        """Move a dead-lettered run back into its queue: QUEUED with a fresh delivery count."""
        async with self.r.locker.lock("redrive", run_id):
            run = await self.r.repo.runs.get_run(run_id, env_id)
            if run is None:
                raise NotFoundError("run", run_id)
            latest = await self.execution_snapshot.latest(run_id)
            if latest.engine_status != E.FINISHED or run.status != RunStatus.SYSTEM_FAILURE:
                raise InvalidTransitionError(run_id, latest.engine_status, "redrive")
            # A run dead-lettered on its way to be restored from its checkpoint (QUEUED_EXECUTING
            # before it died) goes back that way, to resume the same attempt: QUEUED without the
            # checkpoint, its next start would be a new attempt, as if that one had failed.
            before = (await self.r.repo.runs.snapshots_from(run_id, latest.previous_snapshot_id, 1)
                      if latest.previous_snapshot_id else [])
            restore = before[0].checkpoint_id if before and before[0].engine_status == E.QUEUED_EXECUTING else None
            result = await self.execution_snapshot.apply(
                run_id, E.QUEUED_EXECUTING if restore else E.QUEUED, RunStatus.QUEUED, from_statuses=(E.FINISHED,),
                expected_snapshot_id=latest.id, operation="redrive", description="Redriven from the DLQ",
                reopen=True, checkpoint_id=restore,
            )
            assert result.snapshot is not None and result.run is not None
            # Committed: the run is redriven whatever follows (a message left in the DLQ by a
            # failure here is put back in its queue by the reconciler, which finds it QUEUED).
            try:
                if not await self.r.queue.redrive(env_id, run_id, self.r.now_ms()):
                    # The DLQ entry is gone (e.g. Redis was flushed): enqueue it afresh.
                    await self.r.enqueue_items([self.enqueue.item_for(result.run, reset_deliveries=True)])
            except Exception as exc:
                log_failure(log, exc, "run %s redriven; moving its queue message failed (the reconciler will)",
                            run_id)
        self.r.events.emit(RunEvent("run_redriven", run_id, env_id, result.snapshot.id,
                                    attempt=result.run.attempt_number))
        return result.snapshot.id

    @staticmethod
    def _matches(e: DlqEntry, tasks: Collection[str], queues: Collection[str]) -> bool:
        return (not tasks or e.task in tasks) and (not queues or e.queue in queues)

    async def list_dead(self, env_id: str, size: int, after: str | None = None, tasks: Collection[str] = (),
                        queues: Collection[str] = ()) -> tuple[list[DeadRun], str | None]:
        """Up to ``size`` dead-lettered runs matching the filters (empty: all), oldest first, after
        the place ``after`` names (a cursor this returned, or a run id); and the cursor of the next
        page (None: no more). An entry whose run is gone (deleted by retention before its entry
        was) is dropped on the way.

        A call walks at most WALK entries: a filter that matches none of a million entries ends a
        page early (possibly empty) with a cursor at the last entry walked, instead of walking
        them all in one request. The cursor is that entry's place (time and run id), so a page
        goes on from it even if the entry left the DLQ meanwhile."""
        queue = self.r.queue
        runs = self.r.repo.runs
        cursor: str | DlqEntry | None = parse_dlq_cursor(after)
        found: list[DeadRun] = []
        total = 0  # the found runs' payloads, outputs and metadata: a page ends past PAGE_BYTES
        walked = 0
        while True:
            entries = await queue.list_dlq(env_id, limit=self.PAGE, after=cursor)
            walked += len(entries)
            wanted = [e for e in entries if self._matches(e, tasks, queues)]
            # the sizes of this slice's runs first (in order, no further than one past the page's
            # bytes, nor than the runs the page can still take), then the runs that fit: two
            # queries a slice (more only when runs measured were gone: those do not fill the page)
            take: list[DlqEntry] = []
            full = False
            while wanted and not full:
                ids = [e.run_id for e in wanted[:size - len(found) - len(take) + 1]]
                sizes = await runs.run_sizes(env_id, ids, PAGE_BYTES - total)
                rest: list[DlqEntry] = []
                for i, e in enumerate(wanted):
                    if len(found) + len(take) == size or ((found or take) and total > PAGE_BYTES):
                        full = True
                        break
                    if e.run_id not in sizes:  # not measured: the runs measured before it were gone
                        rest = wanted[i:]
                        break
                    measured = sizes[e.run_id]
                    if measured is None:  # deleted by retention before its entry was
                        await queue.forget_dead(env_id, e.run_id)
                        continue
                    take.append(e)
                    total += measured
                if len(rest) == len(wanted):  # nothing measured (not expected): the page ends here
                    full = True
                wanted = rest
            have = await runs.runs_by_ids(env_id, [e.run_id for e in take]) if take else {}
            found += [DeadRun(have[e.run_id], e) for e in take if e.run_id in have]
            if full:  # the next page goes on after the last run this one took
                return found, dlq_cursor(take[-1] if take else found[-1].entry if found else cursor)
            if len(entries) < self.PAGE:
                return found, None
            cursor = entries[-1]  # its place, even if it left the DLQ meanwhile
            if walked >= self.WALK:  # ends early: the next page goes on after the last entry walked
                return found, dlq_cursor(cursor)

    async def redrive_all(self, env_id: str, tasks: Collection[str] = (), queues: Collection[str] = (),
                          after: str | None = None) -> tuple[int, str | None]:
        """Redrive the matching dead-lettered runs after the place ``after`` names (a cursor this
        returned; None: the start); returns how many went back to their queues and the cursor to
        go on from (None: through the DLQ). A call walks at most WALK entries and redrives at most
        REDRIVES runs (each a lock and a write): a DLQ of millions is gone through call after
        call, never in one request of the server every tenant shares."""
        queue = self.r.queue
        count = walked = 0
        cursor: str | DlqEntry | None = parse_dlq_cursor(after, "after")
        while True:
            entries = await queue.list_dlq(env_id, limit=self.PAGE, after=cursor)
            for e in entries:
                if count >= self.REDRIVES or walked >= self.WALK:  # the next call goes on before this one
                    return count, dlq_cursor(cursor)
                walked += 1
                cursor = e  # its place, even if it leaves the DLQ meanwhile
                if not self._matches(e, tasks, queues):
                    continue
                try:
                    await self.redrive(env_id, e.run_id)
                    count += 1
                except NotFoundError:  # deleted by retention before its entry was: drop the entry
                    await queue.forget_dead(env_id, e.run_id)
                except InvalidTransitionError:
                    # It left the DLQ another way meanwhile (cancelled, redriven): drop its entry
                    # if it is still there. Not while it is on its way in (its message is in the DLQ
                    # and its SYSTEM_FAILURE not yet written): dropped then, it would be a failed
                    # run no DLQ page shows.
                    run = await self.r.repo.runs.get_run(e.run_id, env_id, light=True)
                    if run is None or (RunStatus(run.status) in FINAL_RUN_STATUSES
                                       and run.status != RunStatus.SYSTEM_FAILURE):
                        await queue.forget_dead(env_id, e.run_id)
                except (StaleSnapshotError, LockTimeoutError) as exc:  # busy: the others go on
                    log.warning("redrive all: run %s skipped for now (%s); redrive it again", e.run_id, exc)
            if len(entries) < self.PAGE:
                return count, None

    async def rebuild(self, budget: int, *, restart: bool = False) -> tuple[int, int]:
        """Write again the DLQ entries Redis lost, from the runs PostgreSQL shows dead-lettered:
        at most ``budget`` runs read, in batches of REBUILD_PAGE by id, each batch one Redis round
        trip, going on from where the previous call stopped (kept in Redis, so a new leader goes on
        too). ``restart``: from the first run (Redis lost its data; called again until through, and
        once more a grace later for the runs dead-lettered while it was lost). Without a rebuild
        under way this does nothing. Each entry gets its run's time of death (finished at) and the
        DLQ's reason; the delivery count, which PostgreSQL does not keep, is the limit. A run the
        queue knows is left as it is, and a run redriven or deleted meanwhile is never brought back
        (see MaintenanceRepository.dead_runs_page). Returns (entries written, runs read)."""
        queue = self.r.queue
        after = "" if restart else await queue.dlq_rebuild_after()
        if after is None:
            return 0, 0
        if restart:
            await queue.set_dlq_rebuild_after(after)
        restored = read = 0

        async def restore(runs: list[RunRow]) -> None:
            nonlocal restored
            restored += await queue.restore_dead([self._dead_message(run) for run in runs])

        through = False
        while read < budget:
            limit = min(self.REBUILD_PAGE, budget - read)
            n, after = await self.r.repo.maintenance.dead_runs_page(after, limit, restore)
            read += n
            if n < limit:
                through = True
                break
        await queue.set_dlq_rebuild_after(None if through else after)
        if through:
            log.warning("DLQ rebuild: through; %d entries written in its last pass", restored)
        elif read:
            log.warning("DLQ rebuild: %d entries written of %d dead runs read this pass; going on after %s",
                        restored, read, after)
        return restored, read

    def _dead_message(self, run: RunRow) -> DeadMessage:
        dead_at = run.finished_at or run.updated_at
        return DeadMessage(self.enqueue.item_for(run), int(dead_at.timestamp() * 1000), DLQ_REASON,
                           self.r.queue.max_deliveries)
