"""BulkActionsSystem: cancel or replay every run of an environment that matches a filter.

An action covers the runs that existed when it was made (created before it: a replay never
replays its own replays). An engine job works through them a page at a time, newest first, and
records its cursor and counts after each page, so progress is readable while it runs and a
process that dies mid-page costs only that page again: a cancel is a no-op the second time, and
each replay carries an idempotency key made of the action and the run, so it is never made twice.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from run_engine.db.bulk_actions import BulkAction
from run_engine.db.runs import PAGE_BYTES, RunRow
from run_engine.dependencies import log_failure
from run_engine.errors import (
    ConflictError,
    DuplicateExecutionError,
    InvalidTransitionError,
    NotFoundError,
    TooManyError,
    UnprocessableError,
    ValidationError,
)
from run_engine.ids import new_id
from run_engine.statuses import FINAL_RUN_STATUSES, RunStatus
from systems import engine_jobs
from systems.cancel import CancelSystem
from systems.enqueue import EnqueueSystem, TriggerRequest
from systems.resources import SystemResources

log = logging.getLogger(__name__)
PAGE = 100
MAX_PENDING = 10  # bulk actions under way per environment
CANCELS_AT_ONCE = 20  # in this process, of every page
KINDS = ("CANCEL", "REPLAY")
FILTERS = ("statuses", "tasks", "tags", "queues", "batches", "ids")
STORED_KEYS = frozenset({*FILTERS, "created_from", "created_to"})
MAX_IDS = 500  # runs named one by one in an action
#: what an action by run ids stores as its date bound too: an engine that predates ids (before
#: c14d8c5: a rolling deploy, a rollback) reads only the filters it knows, and ids alone would be
#: no filter to it, every run of the environment; with this bound it acts on none
NO_RUN_BEFORE_IDS = "1970-01-01T00:00:00+00:00"


@dataclass(frozen=True, slots=True)
class RunFilter:
    """Runs of an environment: each list narrows (empty: any); created in [created_from, created_to);
    ``ids``: only these runs."""

    statuses: tuple[str, ...] = ()
    tasks: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    queues: tuple[str, ...] = ()
    batches: tuple[str, ...] = ()
    created_from: datetime | None = None
    created_to: datetime | None = None
    ids: tuple[str, ...] = ()

    def stored(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: list(getattr(self, k)) for k in FILTERS if getattr(self, k)}
        for key in ("created_from", "created_to"):
            if (value := getattr(self, key)) is not None:
                out[key] = value.isoformat()
        if self.ids:  # an engine before ids reads the date alone: no run, rather than every run
            out["created_to"] = NO_RUN_BEFORE_IDS
        return out

    @classmethod
    def from_stored(cls, data: dict[str, Any]) -> RunFilter:
        """The filter an action stored; ValueError for one that names what this engine does not
        know (made by a later one): acting on it would act on more runs than asked."""
        if unknown := set(data) - STORED_KEYS:
            raise ValueError(f"the filter names {sorted(unknown)}, which this engine does not know")
        if data.get("ids"):
            return cls(ids=tuple(data["ids"]))

        def date(key: str) -> datetime | None:
            return datetime.fromisoformat(data[key]) if data.get(key) else None

        return cls(statuses=tuple(data.get("statuses", ())), tasks=tuple(data.get("tasks", ())),
                   tags=tuple(data.get("tags", ())), queues=tuple(data.get("queues", ())),
                   batches=tuple(data.get("batches", ())), created_from=date("created_from"),
                   created_to=date("created_to"), ids=tuple(data.get("ids", ())))


#: no seed given: the run's metadata is still the one it was triggered with
_NO_SEED = object()


def replay_request(run: RunRow, idempotency_key: str | None = None, seed: Any = _NO_SEED) -> TriggerRequest:
    """A new run with the task, payload and options of ``run``; its metadata is the one ``run`` was
    triggered with: ``seed`` when its metadata was replaced since (:meth:`RunRepository.seed_metadata`),
    else its own."""
    return TriggerRequest(
        env_id=run.env_id, task_id=run.task_id, payload=run.payload, payload_type=run.payload_type,
        queue=run.queue, concurrency_key=run.concurrency_key, priority_s=run.priority_ms / 1000,
        tags=tuple(run.tags), metadata=run.metadata if seed is _NO_SEED else seed,
        max_attempts=run.max_attempts, retry=run.retry,
        max_duration_s=run.max_duration_s, machine=run.machine, idempotency_key=idempotency_key,
        worker_group_id=run.worker_group_id)


class BulkActionsSystem:
    def __init__(self, resources: SystemResources, *, enqueue: EnqueueSystem, cancel: CancelSystem) -> None:
        self.r = resources
        self.enqueue = enqueue
        self.cancel = cancel
        # the cancels of every page this process runs, of every action and tenant: twenty pages at
        # once (the job worker's slots) of twenty cancels each would queue four hundred of them
        # for the database pool and the run locks every tenant's runs need
        self._cancels = asyncio.Semaphore(CANCELS_AT_ONCE)

    async def create(self, env_id: str, kind: str, run_filter: RunFilter,
                     idempotency_key: str | None = None, name: str | None = None) -> tuple[BulkAction, bool]:
        """A new action (its first page starts at once), or the one ``idempotency_key`` made before."""
        if kind not in KINDS:
            raise ValidationError("kind", "must be CANCEL or REPLAY")
        if run_filter.ids and RunFilter(ids=run_filter.ids) != run_filter:
            raise ValidationError("ids", "runs named by id take no other filter")
        for field in FILTERS:
            values = getattr(run_filter, field)
            most = MAX_IDS if field == "ids" else 100
            if len(values) > most or any(not v or len(v) > 256 for v in values):
                raise ValidationError(field, f"at most {most} values of 1..256 characters")
        made, cached = await self.r.repo.bulk_actions.create(
            id=new_id("bulk"), env_id=env_id, kind=kind, filter=run_filter.stored(), idempotency_key=idempotency_key,
            max_pending=MAX_PENDING, name=name)
        if made is None:  # one tenant's actions must not fill the engine jobs every tenant needs
            raise TooManyError("bulk actions", MAX_PENDING)
        action = made
        if action.status == "PENDING":
            job = engine_jobs.bulk_action(action.id, env_id, self.r.clock.now())
            # A repeated request must not make the job due again while a worker runs its page (a
            # second worker would take the same page at once); it re-arms only a job that is gone.
            # The action is committed: an error now (Redis away) must not answer the request with
            # one, as a client would make the action again (the SDK retries any 5xx by itself: a
            # second replay of every run). The reconciler arms the job of an action under way.
            try:
                if not cached or await self.r.jobs.missing([job[0]]):
                    await self.r.change_jobs(schedule=[job])
            except Exception as exc:
                log_failure(log, exc, "bulk action %s made; its first page waits for the reconciler", action.id)
        return action, cached

    async def get(self, env_id: str, action_id: str) -> BulkAction | None:
        return await self.r.repo.bulk_actions.get(action_id, env_id)

    async def page(self, env_id: str, limit: int, after: tuple[datetime, str] | None = None) -> list[BulkAction]:
        """The environment's actions, newest first, after ``after`` (created_at, id)."""
        return await self.r.repo.bulk_actions.page(env_id, limit, after)

    async def abort(self, env_id: str, action_id: str) -> BulkAction | None:
        """Stop an action under way: no page after the one in hand (if any) is started; that one's
        runs were acted on, and its counts are added. The action as it is then (already finished: unchanged); None when
        the environment has no such action."""
        return await self.r.repo.bulk_actions.abort(action_id, env_id)

    async def run_page(self, action_id: str) -> bool:
        """Act on the next page of the action's runs; True when more remain (the job runs again)."""
        action = await self.r.repo.bulk_actions.get(action_id)
        if action is None or action.status != "PENDING":
            return False
        try:
            f = RunFilter.from_stored(action.filter)
        except ValueError as exc:  # made by a later engine (a rollback): act on nothing
            log.error("bulk action %s stopped without acting: %s", action.id, exc)
            await self.r.repo.bulk_actions.abort(action.id, action.env_id)
            return False
        created_to = min(filter(None, (f.created_to, action.created_at)))
        after = ((action.cursor_created_at, action.cursor_id)
                 if action.cursor_created_at is not None and action.cursor_id is not None else None)
        filters: dict[str, Any] = {"statuses": f.statuses, "tasks": f.tasks, "tags": f.tags, "queues": f.queues,
                                   "batches": f.batches, "after": after, "created_from": f.created_from,
                                   "created_to": created_to, "ids": f.ids}
        if action.kind == "CANCEL":  # a cancel reads no payload: light rows
            runs = await self.r.repo.runs.list_runs(action.env_id, limit=PAGE, light=True, **filters)
            succeeded, done = await self._cancel(action, runs), len(runs) < PAGE
        else:  # a replay copies payloads: a page of them bounded in bytes as well
            runs, more = await self.r.repo.runs.page_runs(action.env_id, limit=PAGE, max_bytes=PAGE_BYTES, **filters)
            succeeded, done = await self._replay(action, runs), not more
        last = (runs[-1].created_at, runs[-1].id) if runs else None
        if await self.r.repo.bulk_actions.advance(
                action.id, expected=(action.cursor_created_at, action.cursor_id), cursor=last, processed=len(runs),
                succeeded=succeeded, done=done):
            return not done
        # Another worker (this page's job taken again after its lease ran out) recorded this page
        # first and goes on with the next. Scheduling the job here too would replace that worker's
        # next job while its page runs: a third worker would do the same page, and every page
        # after it twice. Should that worker die before it scheduled the next page, the reconciler
        # arms the job of an action under way.
        log.info("bulk action %s: a page done twice (its job was taken again); counted once", action.id)
        return False

    async def _cancel(self, action: BulkAction, runs: list[RunRow]) -> int:
        """How many of ``runs`` this action cancelled, all of them at once (the engine's batchers
        make few round trips of them). A run cancelled since the action was made counts too, as
        an earlier try at this page (one that died before recording it, or a second worker on it)
        cancelled it; a run that had finished before is left alone and not counted."""
        # A run cancelled since is cancelled again (a no-op for it): a try that stopped part way
        # down the runs it waits on (a busy lock, a process that died) left some of theirs, which
        # this goes on to; it answers CANCELED, and is counted.
        todo = [run for run in runs if RunStatus(run.status) not in FINAL_RUN_STATUSES
                or (run.status == RunStatus.CANCELED and run.finished_at is not None
                    and run.finished_at >= action.created_at)]

        async def cancel(run_id: str) -> object:
            async with self._cancels:  # the pool and the locks are every tenant's
                return await self.cancel.cancel(run_id)

        outcomes = await asyncio.gather(*(cancel(run.id) for run in todo), return_exceptions=True)
        _retry_unless_refused("cancel", [(run.id, o) for run, o in zip(todo, outcomes, strict=True)])
        # cancelled (CANCELED), or cancelling while it executes (EXECUTING: PENDING_CANCEL); a run
        # that finished on its own since the page was read answers its own final status
        return sum(1 for o in outcomes if o in (RunStatus.CANCELED, RunStatus.EXECUTING))

    async def _replay(self, action: BulkAction, runs: list[RunRow]) -> int:
        if not runs:
            return 0
        seeds = await self.r.repo.runs.seed_metadata([run.id for run in runs])
        requests = [replay_request(run, f"{action.id}:{run.id}", seeds.get(run.id, _NO_SEED)) for run in runs]
        try:
            made = await self.enqueue.trigger_many(requests)
        except Exception:  # one run that cannot be replayed must not stop the others: one at a time
            outcomes = await asyncio.gather(*(self.enqueue.trigger_many([req]) for req in requests),
                                            return_exceptions=True)
            _retry_unless_refused("replay", [(run.id, o) for run, o in zip(runs, outcomes, strict=True)])
            made = [m for o in outcomes if not isinstance(o, BaseException) for m in o]
        # a run found by its key was made by an earlier try at this page: the key is the action's own
        return len(made)


def _retry_unless_refused(what: str, outcomes: list[tuple[str, object]]) -> None:
    """A run the engine refuses (gone, not a state it can leave, its task no longer valid...) is
    skipped and not counted; any other error (a lock busy, PostgreSQL or Redis away, a full queue)
    fails the page, whose job is tried again later: doing a page again does nothing twice."""
    failed = []
    for run_id, outcome in outcomes:
        if isinstance(outcome, REFUSED):
            log.warning("bulk %s: run %s skipped: %s", what, run_id, outcome)
        elif isinstance(outcome, Exception):
            failed.append((run_id, outcome))
        elif isinstance(outcome, BaseException):
            raise outcome
    if failed:
        run_id, first = failed[0]
        raise RuntimeError(f"bulk {what}: {len(failed)} runs could not be done now (first {run_id}: {first!r}); "
                           "the page is tried again") from first


REFUSED = (NotFoundError, InvalidTransitionError, ValidationError, UnprocessableError, ConflictError,
           DuplicateExecutionError)
