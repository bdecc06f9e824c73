"""SchedulesSystem: cron schedules, imperative (API) and declarative (``@task(cron=...)``).

Every engine process plans (the DBOS technique, seeds/002). Each process waits a random jitter
after the tick and first reads whether the tick was already fired, which turns the herd of writes
into mostly reads; then the tick's run is inserted in the transaction that moves the schedule to
its next tick with a compare-and-set (still at that tick, with the task, cron, zone, external id
and worker group read, and no other transaction holding it): however many processes fire the same
tick, and whatever dies between, exactly one run is made, whatever happens to the schedule
meanwhile (its task changed, the schedule deleted or deactivated: none is made once that is
committed). The run's idempotency key is (schedule, tick) too.

A cron is parsed strictly only when a user writes a new one through the API (create, update): the
crons stored or declared before (a schedule's, a deployment's) are read leniently, as the versions
that accepted them read them (``Cron.parse(lenient=True)``), so that they keep firing as they did.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from psycopg import AsyncConnection

from run_engine.cron import Cron, CronError
from run_engine.db.deployments import TaskSpec
from run_engine.db.schedules import DroppedDeclarative, Schedule
from run_engine.errors import NotFoundError, RunEngineError, UnprocessableError, ValidationError
from run_engine.ids import new_id
from run_engine.tasks import stop_task
from run_engine.timings import TIMINGS
from systems.enqueue import TriggerRequest
from systems.resources import SystemResources

if TYPE_CHECKING:
    from systems.enqueue import EnqueueSystem

log = logging.getLogger(__name__)
DECLARATIVE_PREFIX = "declarative:"
host_time = time.time  # this host's clock (the engine's is the same, but in tests)
DUE_PER_POLL = 200  # ticks one poll of one process fires at most
DUE_PER_ENVIRONMENT = 20  # of them, of one environment
FIRING_AT_ONCE = 20  # triggered at once
LENIENT_WARNINGS = 10_000  # schedules whose lenient cron a process remembers having warned of


def schedule_key(schedule_id: str, tick: datetime) -> str:
    return f"schedule:{schedule_id}:{tick.astimezone(UTC).isoformat()}"


def scheduled_payload(schedule: Schedule, tick: datetime) -> dict[str, Any]:
    """What a scheduled run's task receives (the SDK's ``ScheduledPayload``, as Trigger.dev's)."""
    return {"scheduleId": schedule.id, "type": schedule.type, "timestamp": tick.isoformat(),
            "lastTimestamp": schedule.last_run_at.isoformat() if schedule.last_run_at else None,
            "timezone": schedule.timezone, "externalId": schedule.external_id}


class _TickTaken(Exception):
    """Raised in a tick's run insert to leave nothing made: the schedule is no longer as read."""


class SchedulesSystem:
    def __init__(self, resources: SystemResources, *, enqueue: EnqueueSystem) -> None:
        self.r = resources
        self.enqueue = enqueue
        self._task: asyncio.Task[None] | None = None
        self._firing: set[tuple[str, datetime]] = set()
        self._warned_lenient: set[str] = set()  # schedules whose cron is only valid read leniently

    async def _now(self) -> datetime:
        """The database's time (one host's clock stepped an hour ahead must not fire every schedule
        early and skip the ticks between for the whole cluster), moved by what the engine's clock
        says beyond the host's: nothing, but in tests, whose clock is moved by hand."""
        moved = self.r.clock.now() - host_time()
        return await self.r.repo.schedules.now() + timedelta(seconds=moved)

    @staticmethod
    def next_tick(cron: str, timezone: str, after: datetime, *, lenient: bool = False) -> datetime:
        """The first tick after ``after``; ``lenient`` for a cron stored or declared before, read
        as the versions before read it (an empty list item as ``*``, ``/5`` as ``*/5``)."""
        return SchedulesSystem._tick(cron, timezone, after, lenient)[0]

    @staticmethod
    def _tick(cron: str, timezone: str, after: datetime, lenient: bool) -> tuple[datetime, bool]:
        """(the first tick after ``after``, whether the cron is only valid read leniently)."""
        try:
            parsed = Cron.parse(cron, lenient=lenient)
            return parsed.next_after(after, timezone), parsed.read_leniently
        except CronError as exc:
            field = "timezone" if "timezone" in str(exc) else "cron"
            raise ValidationError(field, str(exc)) from None

    def _stored_tick(self, schedule_id: str, cron: str, timezone: str, after: datetime) -> datetime:
        """The next tick of a cron stored or declared before: read leniently, with a warning (once
        per schedule a process) when it is only valid so."""
        following, leniently = self._tick(cron, timezone, after, True)
        if leniently:
            self._warn_lenient(schedule_id, cron)
        return following

    def _warn_lenient(self, schedule_id: str, cron: str) -> None:
        if schedule_id in self._warned_lenient:
            return
        if len(self._warned_lenient) >= LENIENT_WARNINGS:
            self._warned_lenient.clear()
        self._warned_lenient.add(schedule_id)
        log.warning("schedule %s: its cron %r has an empty list item or a step with nothing before it, refused "
                    "for a new cron; read as the versions before read it ('*' for the empty item, '*/n' for "
                    "'/n'), it keeps firing so (write it so to silence this)", schedule_id, cron)

    async def upsert(self, env_id: str, *, task: str, cron: str, timezone: str = "UTC", external_id: str | None = None,
                     deduplication_key: str | None = None, kind: str = "IMPERATIVE",
                     worker_group_id: str | None = None) -> Schedule:
        """Create a schedule; the same deduplication key updates the existing one instead."""
        if not task or len(task) > 128:
            raise ValidationError("task", "must be 1..128 characters")
        if kind == "IMPERATIVE" and deduplication_key is not None and deduplication_key.startswith(DECLARATIVE_PREFIX):
            raise ValidationError("deduplicationKey", f"{DECLARATIVE_PREFIX!r} keys are the deployments' own "
                                                      "(a task's declared cron)")
        now = await self._now()
        # a task's declared cron is a deployment's, which the versions before took (and unchanged code
        # still declares): read leniently; and so is, over the API, the cron the schedule of that
        # deduplication key has already (the SDK's create at every start of an app): not a new cron
        lenient = kind == "DECLARATIVE"
        try:
            next_run, leniently = self._tick(cron, timezone, now, lenient)
        except ValidationError as exc:
            if lenient or exc.field != "cron" or not await self._has_cron(env_id, deduplication_key, cron):
                raise
            next_run, leniently = self._tick(cron, timezone, now, True)
        # every process's planner reads the due schedules each poll: an environment making a million
        # would make each poll of every tenant's schedules read them (a deployment's own, one per
        # task with a cron, are bounded by its tasks)
        cap = self.r.settings.max_schedules_per_env if kind == "IMPERATIVE" else None
        row = await self.r.repo.schedules.upsert(
            id=new_id("sched"), env_id=env_id, task_id=task, cron=cron, timezone=timezone,
            external_id=external_id, deduplication_key=deduplication_key, next_run_at=next_run, type=kind,
            max_schedules=cap, worker_group_id=worker_group_id)
        if row is None:
            raise UnprocessableError("too_many_schedules", f"this environment has {cap} schedules, the most it may "
                                     "have (RUN_ENGINE_MAX_SCHEDULES_PER_ENV); delete one or change one instead")
        if leniently:
            self._warn_lenient(row.id, cron)
        return row

    async def _has_cron(self, env_id: str, deduplication_key: str | None, cron: str) -> bool:
        """Whether the environment's schedule with this deduplication key has this cron already."""
        if deduplication_key is None:
            return False
        row = await self.r.repo.schedules.get_by_deduplication_key(env_id, deduplication_key)
        return row is not None and row.cron == cron

    async def update(self, env_id: str, schedule_id: str, *, task: str, cron: str, timezone: str = "UTC",
                     external_id: str | None = None) -> Schedule:
        """Change an imperative schedule (a declarative one follows its task's ``cron``: 422)."""
        if not task or len(task) > 128:
            raise ValidationError("task", "must be 1..128 characters")
        row = await self.r.repo.schedules.get(schedule_id, env_id)
        if row is None:
            raise NotFoundError("schedule", schedule_id)
        if row.type != "IMPERATIVE":
            raise UnprocessableError("declarative_schedule", "a declarative schedule follows its task's cron: "
                                                             "change the task's declaration instead")
        now = await self._now()
        # the cron it has already (a change of its task or external id) is not a new one: read as before
        next_run = (self._stored_tick(schedule_id, cron, timezone, now) if cron == row.cron
                    else self.next_tick(cron, timezone, now))
        updated = await self.r.repo.schedules.update(schedule_id, env_id, task_id=task, cron=cron, timezone=timezone,
                                                     external_id=external_id, next_run_at=next_run)
        if updated is None:  # deleted meanwhile
            raise NotFoundError("schedule", schedule_id)
        return updated

    async def set_active(self, env_id: str, schedule_id: str, active: bool) -> Schedule:
        row = await self.r.repo.schedules.get(schedule_id, env_id)
        if row is None:
            raise NotFoundError("schedule", schedule_id)
        next_run = self._stored_tick(row.id, row.cron, row.timezone, await self._now()) if active else None
        updated = await self.r.repo.schedules.set_active(schedule_id, env_id, active, next_run)
        if updated is None:  # deleted meanwhile
            raise NotFoundError("schedule", schedule_id)
        return updated

    async def sync_declarative(self, env_id: str, worker_group_id: str, tasks: Sequence[TaskSpec]) -> None:
        """A deployment's ``cron`` declarations become its environment's declarative schedules, of
        its worker group (their runs go there). A schedule of the group's whose task no longer
        declares one goes, unless another group's current deployment declares it (an environment has
        a current deployment per group, and a schedule is keyed by task: the last group to declare
        it took it): that group takes it, with its declared cron and zone."""
        keep = []
        for t in tasks:
            if t.cron is None:
                continue
            key = DECLARATIVE_PREFIX + t.id
            keep.append(key)
            await self.upsert(env_id, task=t.id, cron=t.cron.pattern, timezone=t.cron.timezone,
                              deduplication_key=key, kind="DECLARATIVE", worker_group_id=worker_group_id)
        stored = self.r.repo.schedules
        dropped = await stored.dropped_declarative(env_id, worker_group_id, keep)
        if not dropped:
            return
        now = await self._now()
        handoffs: list[tuple[DroppedDeclarative, datetime | None]] = []
        for d in dropped:
            if d.declared_cron is None or d.declared_timezone is None:
                continue  # nobody else declares it: deleted
            following = None
            if (d.declared_cron, d.declared_timezone) != (d.cron, d.timezone):
                try:
                    following = self._stored_tick(d.schedule_id, d.declared_cron, d.declared_timezone, now)
                except ValidationError as exc:
                    # left as it is (still declared: not deleted), until that group's next connect
                    log.warning("schedule %s: not handed to worker group %s, whose cron %r (%s) has no next tick "
                                "here: %s", d.schedule_id, d.worker_group_id, d.declared_cron, d.declared_timezone,
                                exc)
                    continue
            handoffs.append((d, following))
        handed, _ = await stored.drop_declarative(env_id, worker_group_id, keep, handoffs)
        if handed:
            log.info("environment %s: worker group %s no longer declares %d cron(s) another group's current "
                     "deployment declares: handed to that group", env_id, worker_group_id, handed)

    # --- firing -------------------------------------------------------------------------------

    async def fire_due(self, jitter_s: float | None = None) -> int:
        """Fire every due tick once (after a random jitter); the number of runs this call created.
        At most :data:`DUE_PER_POLL` ticks a poll, :data:`DUE_PER_ENVIRONMENT` of one environment,
        :data:`FIRING_AT_ONCE` triggered at once."""
        jitter = self.r.settings.schedule_jitter_s if jitter_s is None else jitter_s
        now = await self._now()
        due = await self.r.repo.schedules.due(now, DUE_PER_POLL, DUE_PER_ENVIRONMENT)
        fresh = [row for row in due if (row.id, row.next_run_at) not in self._firing]
        if not fresh:
            return 0
        gate = asyncio.Semaphore(FIRING_AT_ONCE)  # the database pool is every tenant's
        created = await asyncio.gather(*(self._fire(row, jitter, now, gate) for row in fresh))
        return sum(created)

    async def _fire(self, row: Schedule, jitter: float, now: datetime, gate: asyncio.Semaphore) -> int:
        tick = row.next_run_at
        assert tick is not None  # due schedules have a next tick
        mark = (row.id, tick)
        self._firing.add(mark)
        try:
            if jitter > 0:
                await asyncio.sleep(self.r.rng.uniform(0, jitter))
            async with gate:
                return await self._fire_now(row.id, tick, now)
        except Exception:
            log.exception("schedule %s: could not fire the tick of %s", row.id, tick)
            return 0
        finally:
            self._firing.discard(mark)

    async def _fire_now(self, schedule_id: str, tick: datetime, now: datetime) -> int:
        current = await self.r.repo.schedules.get(schedule_id)
        if current is None or not current.active or current.next_run_at != tick:
            return 0  # fired by another process meanwhile (a read, not a write), or changed
        # the schedule as it is now (its task may have changed since the poll read it); one that
        # fell behind resumes from now, not every missed tick. The next tick first: a schedule
        # whose next tick cannot be worked out (its zone gone from this host) is stopped, never
        # left due at the head of the list, fired again at every poll before every other tenant's
        try:
            following = self._stored_tick(current.id, current.cron, current.timezone, max(tick, now))
        except ValidationError as exc:
            log.error("schedule %s stopped: its next tick after %s cannot be worked out: %s", schedule_id, tick, exc)
            if await self.r.repo.schedules.deactivate(schedule_id, tick):  # (not by another process first)
                TIMINGS.schedule_tick("stopped")
            return 0

        async def take(conn: AsyncConnection[Any]) -> None:
            # in the run's transaction: the tick is the run's only if the schedule is still as read
            if not await self.r.repo.schedules.take_tick(conn, current, following):
                raise _TickTaken

        try:
            run = await self.enqueue.trigger_many([TriggerRequest(
                env_id=current.env_id, task_id=current.task_id, payload=scheduled_payload(current, tick),
                idempotency_key=schedule_key(current.id, tick), idempotency_key_ttl_s=30 * 86400,
                trigger_function="trigger", tags=(f"schedule:{current.id}",),
                worker_group_id=current.worker_group_id)], guard=take)
        except _TickTaken:
            # fired by another process meanwhile, or being fired; or the schedule changed, was
            # deleted or deactivated (a changed schedule's tick is fired as it is now, next poll)
            return 0
        except RunEngineError as refused:
            # Refused for the environment's own reasons (its queue is full, its task cannot be
            # triggered): this tick is skipped, not tried again at every poll, where it would
            # stay at the head of the due list, before every other tenant's schedules.
            log.warning("schedule %s: the tick of %s was refused and is skipped: %s", schedule_id, tick, refused)
            if await self.r.repo.schedules.advance(schedule_id, tick, following):  # once, whoever skips it
                TIMINGS.schedule_tick("skipped")
            return 0
        if run[0].is_cached:
            return 0
        TIMINGS.schedule_tick("fired")
        return 1

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while self._task is not None:
            try:
                await self.fire_due()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("schedule planner failed; retrying", exc_info=True)
            await asyncio.sleep(self.r.settings.schedule_poll_s)

    async def stop(self) -> None:
        task, self._task = self._task, None  # the loop ends when it sees None
        await stop_task(task)
