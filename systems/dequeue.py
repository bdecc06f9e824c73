"""DequeueSystem: take runs off the queue for a worker group and mark them PENDING_EXECUTING.

One Lua call takes up to ``max_runs`` runs; one lock call and one statement move them all. A
worker that says which deployments it runs is only handed runs of tasks those have: during a
rolling deploy an old worker gives a new task's run back (another worker takes it), and a run of a
task that no current deployment has waits as PENDING_VERSION. A run is never failed for it."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from run_engine.batching import is_committed
from run_engine.db.runs import DequeueStart, RunRow, Snapshot, Transition, TransitionResult
from run_engine.db.waitpoints import journal_page_of
from run_engine.dependencies import log_failure, unavailable_dependency
from run_engine.events import RunEvent
from run_engine.ids import new_id
from run_engine.run_queue import Handed
from run_engine.run_queue.models import DequeuedMessage
from run_engine.statuses import DEQUEUEABLE, HANDED_OUT, ExecutionStatus, RunStatus
from run_engine.timings import TIMINGS
from systems import engine_jobs
from systems.resources import SystemResources

if TYPE_CHECKING:
    from systems.dead_letter import DeadLetterSystem
    from systems.enqueue import EnqueueSystem
    from systems.execution_snapshot import ExecutionSnapshotSystem
    from systems.run_attempt import RunAttemptSystem, StartedAttempt
    from systems.waitpoints import WaitpointsSystem

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DequeuedRun:
    run: RunRow
    snapshot: Snapshot
    deliveries: int
    started: StartedAttempt | None = None  # its attempt, when the dequeue started it too


def _the_runs_fault(exc: Exception) -> bool:
    """An error in the data of the one run a statement was about (PostgreSQL's class 22, data
    exception, or 54, program limit exceeded: a value too large...), not a fault of the system."""
    return (getattr(exc, "sqlstate", None) or "")[:2] in ("22", "54")


class DequeueSystem:
    def __init__(self, resources: SystemResources, *, execution_snapshot: ExecutionSnapshotSystem,
                 enqueue: EnqueueSystem, run_attempt: RunAttemptSystem, waitpoints: WaitpointsSystem,
                 dead_letter: DeadLetterSystem) -> None:
        self.r = resources
        self.dead_letter = dead_letter
        self.execution_snapshot = execution_snapshot
        self.enqueue = enqueue
        self.run_attempt = run_attempt
        self.waitpoints = waitpoints
        self._deployments: dict[str, tuple[str, frozenset[str]]] = {}
        # run → (times this process gave it back in a row, when last): see _give_back_delay_ms
        self._given_back: dict[str, tuple[int, int]] = {}

    GIVE_BACK_MS = 500  # a run given back is ready again this much later (the others' turn first)
    GIVE_BACK_FREE = 8  # give-backs in a row at GIVE_BACK_MS (a worker that has it is likely among them)
    GIVE_BACK_MAX_MS = 30_000  # then doubling with each, up to this
    DESCRIPTION = "Dequeued by a worker"

    async def dequeue(self, worker_group_id: str, max_runs: int, worker_id: str | None = None,
                      environments: Sequence[str] = (), deployments: Sequence[str] = (),
                      start: bool = False) -> Handed:
        """Up to ``max_runs`` runs as :class:`DequeuedRun` (only of ``environments`` when given, only
        of tasks the worker's ``deployments`` have when given); the result's ``retry_at_ms`` says
        when a rate-limited queue of the group may serve again, its ``backlog`` whether runs of
        the group were still ready once it was done. With ``start``, each run's attempt
        is started in the same transaction (PENDING_EXECUTING, then EXECUTING: both snapshots
        kept) and comes back as its ``started``."""
        began = time.perf_counter()
        handed = await self._dequeue(worker_group_id, max_runs, worker_id, environments, deployments, start)
        TIMINGS.dequeue("runs" if handed else "empty", time.perf_counter() - began)
        return handed

    async def _dequeue(self, worker_group_id: str, max_runs: int, worker_id: str | None,
                       environments: Sequence[str], deployments: Sequence[str], start: bool) -> Handed:
        messages = await self.r.queue.dequeue(worker_group_id, max_runs, self.r.now_ms(), environments)
        # No run lock: the compare-and-set from a dequeueable status decides. A run that moved on
        # meanwhile (a cancel or a TTL applies its snapshot before it touches the queue) is not
        # applied here and its message is dropped; the others' jobs are keyed by snapshot.
        results: Sequence[TransitionResult]
        starts: Sequence[TransitionResult | None]
        try:
            if messages and deployments:
                retry_at, backlog = messages.retry_at_ms, messages.backlog
                messages = Handed(await self._runnable(messages, worker_group_id, deployments))
                messages.retry_at_ms, messages.backlog = retry_at, backlog
            if not messages:
                return messages
            handed_out: Sequence[DequeuedMessage] = messages
            if start:
                # one statement: PENDING_EXECUTING, then the attempt's EXECUTING after it (both kept)
                handed_out, triples = await self._start_split(messages, worker_id)
                results, starts = [p for p, _, _ in triples], [s for _, s, _ in triples]
                journals = [j for _, _, j in triples]
            else:
                froms = tuple(DEQUEUEABLE)
                results = await self.execution_snapshot.append_many([
                    Transition(run_id=m.run_id, new_snapshot_id=new_id("snapshot"),
                               engine_status=ExecutionStatus.PENDING_EXECUTING, run_status=RunStatus.DEQUEUED,
                               from_statuses=froms, description=self.DESCRIPTION, worker_id=worker_id)
                    for m in messages])
                starts = [None] * len(results)
                journals = [None] * len(results)
        except Exception as exc:
            if unavailable_dependency(exc) is not None and not is_committed(exc):
                await self._give_back(messages)
            raise
        dequeued: list[DequeuedRun] = []
        stray: list[tuple[str, str]] = []
        stray_deliveries: list[int | None] = []
        stray_held_at: list[int | None] = []
        written: list[DequeuedMessage] = []  # the messages of the runs this dequeue wrote
        cancel: list[str] = []
        schedule: list[engine_jobs.JobSpec] = []
        timeout = self.r.settings.pending_executing_timeout_s
        for message, result, started, journal in zip(handed_out, results, starts, journals, strict=True):
            if not (result.applied and result.snapshot is not None and result.run is not None):
                if result.latest_status in HANDED_OUT:
                    # Another dequeue wrote the run while this one held its message (made ready
                    # again by the reconciler while that one stalled, then taken here): the run is
                    # that one's worker's, and this delivery is its slot. Kept held, freed by the
                    # run's own ack; dropped, the run ran with no slot and its queue's limit let
                    # one more run out beside it.
                    continue
                # The run moved on (finished, cancelled) while its message was queued: drop it.
                # Only this delivery's: a dequeue that stalled past the reconciler's grace finds
                # the run made ready again and handed out since, whose slot it must not free.
                stray.append((message.env_id, message.run_id))
                stray_deliveries.append(message.deliveries)
                stray_held_at.append(message.held_at_ms)  # the count alone: a retry resets it
                continue
            written.append(message)
            if started is not None and started.applied and started.run is not None \
                    and started.snapshot is not None:
                try:
                    attempt, c, s = await self.run_attempt.attempt_started(
                        started.run, started.snapshot, result.snapshot.id, pending_job=False,
                        journal=None if journal is None else await self.waitpoints.resolve_journal(
                            message.run_id, journal_page_of(journal)))
                except Exception:
                    # Committed: the run is EXECUTING, but what its worker needs could not be
                    # worked out (its policy, its journal). It is not handed out, and the other runs
                    # of this dequeue (of any tenant) go on; its heartbeat job times it out and
                    # it is retried.
                    log.exception("dequeue: run %s started, but its attempt could not be prepared", message.run_id)
                    schedule += self.execution_snapshot.rearm(None, None, started.snapshot)[1]
                    continue
                cancel += c
                schedule += s
                dequeued.append(DequeuedRun(result.run, result.snapshot, message.deliveries, attempt))
            else:
                schedule.append(engine_jobs.heartbeat(result.run.id, result.snapshot.id,
                                                      self.r.clock.now() + timeout))
                dequeued.append(DequeuedRun(result.run, result.snapshot, message.deliveries))
        # A dequeue that took longer than half the reconciler's grace may have had its runs made
        # ready again (their slots freed) before it wrote them: it takes back what it finds so.
        # (The rest of the grace is for the clocks of the leader and this process to differ.)
        # (A dequeue's messages share their take's time.)
        now = self.r.now_ms()
        took = written[0].held_at_ms if written else None
        late = written if took is not None and now - took > self.r.settings.reconcile_grace_s * 500 else ()
        # committed: the runs are the worker's now, answered all the same (a stray's message the
        # ack missed stays held until the reconciler drops it; a lost job is re-armed by the runs'
        # start or heartbeat; a run not taken back runs with no slot until the next dequeue of its
        # queue takes its message and keeps it, above)
        await self.r.after_commit("dequeue",
                                  *([self.r.queue.ack(stray, deliveries=stray_deliveries,
                                                                  held_at=stray_held_at)] if stray else []),
                                  *([self._reclaim(late, now)] if late else []),
                                  self.r.change_jobs(cancel, schedule))
        for d in dequeued:
            self.r.events.emit(RunEvent("run_dequeued", d.run.id, d.run.env_id, d.snapshot.id,
                                        attempt=d.run.attempt_number))
            if d.started is not None:
                self.run_attempt.emit_started(d.started)
        out = Handed(dequeued)
        out.retry_at_ms, out.backlog = messages.retry_at_ms, messages.backlog
        return out

    async def _reclaim(self, messages: Sequence[DequeuedMessage], now: int) -> None:
        taken = await self.r.queue.reclaim_many(
            [(m.env_id, m.run_id, m.deliveries, m.held_at_ms or 0) for m in messages], now)
        if any(taken):
            log.warning("dequeue: runs %s were made ready again while their dequeue stalled before writing them; "
                        "their slots taken back", [m.run_id for m, t in zip(messages, taken, strict=True) if t][:20])

    async def _start_split(self, messages: Sequence[DequeuedMessage], worker_id: str | None,
                           ) -> tuple[list[DequeuedMessage], list[tuple[TransitionResult, TransitionResult, Any]]]:
        """Dequeue and start the messages' runs in one statement. When it fails before its commit
        and not for an outage, the batch is split in halves down to the runs that fail on their
        own (a journal too large to replay...): one run's data must not keep the other runs of the
        batch, of every tenant, from being handed out. Those runs are given back to their queues
        and, past the delivery limit, dead-lettered; any other fault is everyone's (a read-only
        standby, a schema mid-deploy): the call fails (when nothing was handed out) and the
        runs stay held for the reconciler. Only an error in a run's data (PostgreSQL's classes 22
        and 54) is the run's. An outage fails the call and its runs are given back (see
        :meth:`_give_back`); once split, only the halves it failed. A half that fails after its
        commit (its runs started, their rows not read back) is neither given back nor tried
        again: the reconciler re-arms its runs' timeouts, as for an unsplit call; the halves
        started meanwhile are handed out all the same (the call fails only when none was). The
        messages handed out, their results."""
        failed: list[tuple[DequeuedMessage, Exception]] = []
        handed, results = await self._start_all(messages, worker_id, failed)
        started = [exc for _, exc in failed if is_committed(exc)]
        failed = [(m, exc) for m, exc in failed if not is_committed(exc)]
        theirs = [(m, exc) for m, exc in failed if _the_runs_fault(exc)]
        for m, exc in theirs:
            await self._not_handed_out(m, exc)
        if down := [m for m, exc in failed if unavailable_dependency(exc) is not None]:
            await self._give_back(down)
        everyones = [exc for _, exc in failed if not _the_runs_fault(exc) and unavailable_dependency(exc) is None]
        if started and not handed:
            raise started[0]  # as unsplit: the runs are started, the reconciler re-arms them
        if started:
            log.error("dequeue: %d runs started but could not be read back; left for the reconciler to re-arm "
                      "(their heartbeat timeout retries them)", len(started), exc_info=started[0])
        if everyones:
            if not handed and not theirs:
                raise everyones[0]
            log.error("dequeue: %d runs could not be handed out; left held for the reconciler", len(everyones),
                      exc_info=everyones[0])
        return handed, results

    async def _start_all(self, messages: Sequence[DequeuedMessage], worker_id: str | None,
                         failed: list[tuple[DequeuedMessage, Exception]], *, split: bool = False,
                         ) -> tuple[list[DequeuedMessage], list[tuple[TransitionResult, TransitionResult, Any]]]:
        """See :meth:`_start_split`; the runs that failed on their own are added to ``failed``. An
        outage, or a failure after the commit, fails the whole call, unless part of it was split
        off (and may have committed): then the runs of the halves it failed are added to
        ``failed`` too."""
        try:
            triples = await self.r.repo.runs.dequeue_and_start(
                [DequeueStart(m.run_id, new_id("snapshot"), new_id("snapshot"), worker_id) for m in messages],
                self.DESCRIPTION, self.run_attempt.START_DESCRIPTION)
            return list(messages), triples
        except Exception as exc:
            if is_committed(exc):  # its runs started: not to be tried again (the reconciler re-arms them)
                if not split:
                    raise
                # once split, the other halves go on: those started are handed out, not dropped
                # with this half's error (they would wait for the reconciler, then a heartbeat timeout)
                failed += [(m, exc) for m in messages]
                return [], []
            if unavailable_dependency(exc) is not None:
                if not split:
                    raise
                log_failure(log, exc, "dequeue: %d runs not started", len(messages))
                failed += [(m, exc) for m in messages]
                return [], []
            if len(messages) == 1:
                failed.append((messages[0], exc))
                return [], []
        mid = len(messages) // 2
        first, first_results = await self._start_all(messages[:mid], worker_id, failed, split=True)
        second, second_results = await self._start_all(messages[mid:], worker_id, failed, split=True)
        return first + second, first_results + second_results

    async def _give_back(self, messages: Sequence[DequeuedMessage]) -> None:
        """Runs whose statement failed for an outage, before its commit: back to their queues at
        once (their place kept, the delivery undone), one call for all. Left held, each would
        take a slot of its environment until the reconciler's budgeted scan came round to it,
        and the supervisors polling through the outage would fill every limit. If the statement
        did commit and only its answer was lost (a connection cut mid-commit looks the same),
        the next dequeue of such a run fails its compare-and-set (the run is not QUEUED) and
        drops the message: never started twice. Best-effort: when Redis is unreachable too, the
        runs stay held for the reconciler. No wake-up: pollers woken would only fail again."""
        try:
            now = self.r.now_ms()
            await self.r.queue.give_back_many([(m.env_id, m.run_id) for m in messages], now, now)
        except Exception as exc:
            log_failure(log, exc, "dequeue: %d runs could not be given back; left held for the reconciler",
                        len(messages))

    async def _not_handed_out(self, m: DequeuedMessage, exc: Exception) -> None:
        """A run whose dequeue fails on its own: back to its queue (the queue's back-off), to the
        DLQ past its delivery limit; then it ends SYSTEM_FAILURE."""
        log.error("dequeue: run %s could not be handed out; given back to its queue", m.run_id, exc_info=exc)
        try:
            # under the run's lock, as every other way into the DLQ: between the message's move and
            # the run's SYSTEM_FAILURE, a redrive (or the reconciler) would find a QUEUED run whose
            # message is dead-lettered, and take it apart
            async with self.r.locker.lock("dead_letter", m.run_id):
                outcome = await self.r.queue.nack(m.env_id, m.run_id, self.r.now_ms())
                if outcome.dead_lettered:
                    await self.dead_letter.finish_dead(
                        m.run_id, m.env_id, (ExecutionStatus.QUEUED, ExecutionStatus.QUEUED_EXECUTING), None,
                        {"type": "INTERNAL_ERROR", "code": "TASK_RUN_NOT_HANDED_OUT",
                         "message": f"The run could not be handed out to a worker ({type(exc).__name__})"},
                        outcome.deliveries)
        except Exception as again:  # it stays held: the reconciler makes it ready again
            log_failure(log, again, "dequeue: run %s could not be given back", m.run_id)

    async def _tasks_of(self, deployments: Sequence[str]) -> dict[str, frozenset[str]]:
        """environment id → the tasks the worker's deployments have there (deployments never change)."""
        missing = [d for d in deployments if d not in self._deployments]
        if missing:
            if len(self._deployments) > 10_000:
                self._deployments.clear()
            self._deployments.update(await self.r.repo.deployments.deployment_tasks(missing))
        out: dict[str, frozenset[str]] = {}
        for d in deployments:
            if d in self._deployments:
                env_id, tasks = self._deployments[d]
                out[env_id] = out.get(env_id, frozenset()) | tasks
        return out

    async def _runnable(self, messages: Sequence[DequeuedMessage], worker_group_id: str,
                        deployments: Sequence[str]) -> list[DequeuedMessage]:
        tasks = await self._tasks_of(deployments)
        # runs triggered with lockToVersion are their version's deployment's only
        locks = await self.r.repo.runs.version_locks([m.run_id for m in messages])
        own = set(deployments)
        keep: list[DequeuedMessage] = []
        foreign: list[DequeuedMessage] = []
        anywhere = frozenset().union(*tasks.values())
        for m in messages:
            # a run of an environment none of the worker's deployments is in (a group shared with
            # an environment made after it connected) is the worker's when one of its deployments
            # elsewhere has the task (its code); else foreign: its executor would fail it
            if m.run_id in locks:
                mine = locks[m.run_id] in own
            else:
                mine = m.task in tasks[m.env_id] if m.env_id in tasks else m.task in anywhere
            (keep if mine else foreign).append(m)
        for m in foreign:
            try:
                await self._not_for_this_worker(m, worker_group_id, locked=m.run_id in locks)
            except Exception:  # it stays held: the reconciler makes it ready again
                log.exception("run %s: could not give it back", m.run_id)
        return keep

    async def _not_for_this_worker(self, m: DequeuedMessage, worker_group_id: str, *, locked: bool = False) -> None:
        """A run of a task the worker lacks (or locked to another version): back to the queue for
        another worker, or, when the current deployment lacks the task too, PENDING_VERSION until
        one has it (never a run locked to a version: that version's deployment has its task)."""
        now = self.r.now_ms()
        current = None if locked else await self.enqueue.current_task(m.env_id, worker_group_id, m.task)
        if current is not None and current.deployment_id is None:
            async with self.r.locker.lock("pending_version", m.run_id):
                (result,) = await self.execution_snapshot.append_many([Transition(
                    run_id=m.run_id, new_snapshot_id=new_id("snapshot"), engine_status=ExecutionStatus.PENDING_VERSION,
                    run_status=RunStatus.PENDING_VERSION, from_statuses=(ExecutionStatus.QUEUED,),
                    description=f"No current deployment has the task {m.task!r}")])
                if result.applied:
                    await self.r.queue.remove(m.env_id, m.run_id)
                    return
        await self.r.queue.give_back(m.env_id, m.run_id, now, now + self._give_back_delay_ms(m.run_id, now))
        self.r.work_available([worker_group_id])

    def _give_back_delay_ms(self, run_id: str, now: int) -> int:
        """How long a run given back waits: GIVE_BACK_MS for its first GIVE_BACK_FREE give-backs in
        a row (in a rolling deploy a worker that has its task is among those asking: it takes the
        run within a few seconds), then doubling with each up to GIVE_BACK_MAX_MS. A run that no
        worker asking can take (locked to a version whose workers are gone; a task only a worker
        that left had) was handed out and given back twice a second for good: ten thousand of
        them, twenty thousand dequeues and give-backs a second that the group's workers paid for."""
        times, last = self._given_back.get(run_id, (0, 0))
        times = times + 1 if now - last <= self.GIVE_BACK_MAX_MS * 2 else 1
        if len(self._given_back) >= 100_000:
            self._given_back.clear()
        self._given_back[run_id] = (times, now)
        doublings = max(0, times - self.GIVE_BACK_FREE)
        return int(min(self.GIVE_BACK_MAX_MS, self.GIVE_BACK_MS * 2 ** min(doublings, 16)))
