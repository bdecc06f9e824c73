"""The one object every system receives: storage, queue, locks, jobs, events, clock, settings."""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

from run_engine.batching import Batcher
from run_engine.clock import Clock
from run_engine.db.repository import Repository
from run_engine.db.runs import NewRun, RunRow, Snapshot, Transition, TransitionResult
from run_engine.events import EventBus
from run_engine.jobs import JobQueue
from run_engine.locking import RunLocker
from run_engine.records import record
from run_engine.run_queue import EnqueueItem, RunQueue
from run_engine.settings import EngineSettings
from systems.engine_jobs import JobSpec

log = logging.getLogger(__name__)


def _log_lost_call(what: str, exc: BaseException | None) -> None:
    log.warning("%s: committed, but a queue or jobs call after it failed (repaired later): %r", what, exc)


def _log_if_failed(what: str, call: asyncio.Future[object]) -> None:
    if not call.cancelled() and call.exception() is not None:
        _log_lost_call(what, call.exception())


@record
class JobChange:
    cancel: tuple[str, ...]
    schedule: tuple[JobSpec, ...]


@dataclass(eq=False)
class SystemResources:
    repo: Repository
    queue: RunQueue
    locker: RunLocker
    jobs: JobQueue
    events: EventBus
    clock: Clock
    settings: EngineSettings
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        # Group commit: concurrent state changes share one statement / one Lua call. Every write
        # of a kind goes through its batcher, one item or many (``submit_many`` keeps a caller's
        # items together: they succeed or fail as one).
        self.transitions: Batcher[Transition, TransitionResult] = Batcher(self.repo.runs.transition_many)
        self.inserts: Batcher[NewRun, bool] = Batcher(self._insert_runs)
        self.enqueues: Batcher[EnqueueItem, None] = Batcher(self._enqueue)
        # env, run, worker group, held only
        self.acks: Batcher[tuple[str, str, str, bool], None] = Batcher(self._ack)
        self._work_listeners: list[Callable[[str], None]] = []
        self.job_changes: Batcher[JobChange, None] = Batcher(self._apply_jobs)
        self._run_reads: Batcher[str, tuple[RunRow, Snapshot] | None] = Batcher(self._read_runs)

    def now_ms(self) -> int:
        return int(self.clock.now() * 1000)

    async def transition_many(self, transitions: Sequence[Transition]) -> list[TransitionResult]:
        """Append snapshots (one statement, shared with concurrent callers); results in order."""
        return await self.transitions.submit_many(transitions)

    async def run_with_latest(self, run_id: str) -> tuple[RunRow, Snapshot] | None:
        """The run and its latest snapshot (one query, shared with concurrent callers: engine
        jobs about many runs come due together)."""
        return await self._run_reads.submit(run_id)

    async def _read_runs(self, run_ids: list[str]) -> list[tuple[RunRow, Snapshot] | None]:
        found = await self.repo.runs.runs_with_latest(run_ids)
        return [found.get(run_id) for run_id in run_ids]

    async def insert_runs(self, runs: Sequence[NewRun]) -> set[str]:
        """Insert runs and their first snapshots, all or none of them; the ids inserted (a run
        whose idempotency key is taken is not)."""
        flags = await self.inserts.submit_many(runs)
        return {run.id for run, inserted in zip(runs, flags, strict=True) if inserted}

    async def _insert_runs(self, runs: list[NewRun]) -> list[bool]:
        inserted = await self.repo.runs.insert_runs(runs)
        return [r.id in inserted for r in runs]

    @staticmethod
    async def after_commit(what: str, *calls: Awaitable[object]) -> None:
        """The Redis calls (queue, jobs) that follow a committed PostgreSQL change, together; one
        that fails is logged, not raised: the change stands, and an error would tell its caller
        (a worker, which then gives the run up) that it did not. What the call would have done is
        repaired later: a lost job by the run's next heartbeat or the leader's re-arm, a lost
        enqueue or ack by the reconciler, a lost continuation by the waitpoint sweeper.

        The calls of :meth:`change_jobs`, :meth:`ack_many` and :meth:`enqueue_items` are futures,
        their items already with their batchers: they go on together with no task of their own.
        A coroutine among several becomes a task first, so that each call starts before any is
        waited for."""
        started = [asyncio.ensure_future(c) for c in calls] if len(calls) > 1 else calls
        for i, call in enumerate(started):
            try:
                await call
            except Exception as exc:  # noqa: PERF203 (two or three calls)
                _log_lost_call(what, exc)
            except BaseException:  # cancelled: the calls not waited for go on; their failures are logged
                for rest in started[i + 1:]:
                    if isinstance(rest, asyncio.Future):
                        rest.add_done_callback(functools.partial(_log_if_failed, what))
                raise

    def change_jobs(self, cancel: Sequence[str] = (), schedule: Sequence[JobSpec] = ()) -> Awaitable[object]:
        """Cancel and (re)schedule engine jobs; concurrent callers share one Redis call. The
        change is with the batcher when this returns; await the result to know it was made."""
        return self.job_changes.submit_many_now((JobChange(tuple(cancel), tuple(schedule)),) if cancel or schedule
                                                else ())

    async def _apply_jobs(self, changes: list[JobChange]) -> list[None]:
        await self.jobs.apply([i for c in changes for i in c.cancel], [j for c in changes for j in c.schedule])
        return [None] * len(changes)

    def on_work(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(worker_group_id)`` whenever a group may have new work: runs were
        enqueued for it, or runs of it finished and freed concurrency (long-poll wake-ups)."""
        self._work_listeners.append(listener)

    def work_available(self, worker_groups: Iterable[str]) -> None:
        for group in set(worker_groups):
            for listener in self._work_listeners:
                listener(group)

    def enqueue_items(self, items: Sequence[EnqueueItem]) -> Awaitable[object]:
        """Put runs into the run queue (one Lua call, shared with concurrent callers); queued with
        the batcher when this returns, as :meth:`change_jobs`."""
        return self.enqueues.submit_many_now(items)

    async def _enqueue(self, items: list[EnqueueItem]) -> list[None]:
        await self.queue.enqueue(items, self.now_ms())
        self.work_available(i.worker_group for i in items)
        return [None] * len(items)

    def ack_many(self, items: Sequence[tuple[str, str, str]], *, held_only: bool = False) -> Awaitable[object]:
        """Remove finished runs from the queue, freeing their concurrency (env, run, worker group).
        ``held_only`` (a suspension): only messages still held by the dequeue that handed the runs
        out; a run that a continuation enqueued again in the meantime keeps its new message.
        Queued with the batcher when this returns, as :meth:`change_jobs`."""
        return self.acks.submit_many_now([(env, run, group, held_only) for env, run, group in items])

    async def _ack(self, items: list[tuple[str, str, str, bool]]) -> list[None]:
        await self.queue.ack([(env, run) for env, run, _, _ in items], held_only=[h for *_, h in items])
        self.work_available(group for _, _, group, _ in items)
        return [None] * len(items)
