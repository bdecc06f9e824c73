"""Engine jobs: delayed jobs in Redis with fixed ids (DESIGN.md §8).

* ``schedule`` with an id that exists replaces the job (new payload, time and token): rescheduling
  is debouncing; ``ack`` cancels a pending job.
* ``claim`` leases due jobs atomically (score := now + visibility timeout); a consumer that dies
  lets the lease run out and the job is delivered again (at least once: handlers are idempotent).
* ``complete`` / ``fail`` act only if the job still carries the claimed token, so a job that was
  rescheduled while its handler ran survives. ``fail`` retries with back-off, then moves the job to
  the job DLQ. A job whose kind the claiming process has no handler for (a process of an older
  version, during a rolling upgrade or after a rollback) is no failure: it goes back as it was (no
  attempt counted) ``UNKNOWN_KIND_DELAY_S`` later, for a process that knows the kind. A job whose
  stored item is not a job (corrupted, written by hand) goes to the job DLQ as the claim reads it.
* The job DLQ keeps each dead job with its last error and the time it died (``dead_at``, ms); an
  operator lists it a page at a time (``dead_page``, HSCAN), puts jobs back to run now with their
  attempts reset (``retry_dead``) or deletes entries (``drop_dead``), each entry acted on atomically
  and only while it is the one read (``lua/jobs_dlq.lua``); the leader's retention deletes entries
  older than ``job_dlq_retention_days`` a page at a time (``trim_dead``).
* Each job is in a lane: the default one (``""``), claimed first, or an environment's. Lanes with
  jobs due take turns, so one tenant's flood of timers coming due at once does not hold back
  another's (``lua/jobs_lib.lua`` lays out the keys).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import orjson
from redis.asyncio import Redis

from run_engine.batching import Batcher
from run_engine.clock import Clock
from run_engine.dependencies import log_failure, unavailable_dependency
from run_engine.epochs import epoch_value, recheck_time
from run_engine.lua_scripts import LuaScript
from run_engine.records import record
from run_engine.tasks import stop_task

log = logging.getLogger(__name__)
#: a job of a kind this process does not know goes back this long later, its attempts untouched
UNKNOWN_KIND_DELAY_S = 10.0
#: a handler keeps its job's lease while it runs, for this many leases at most (5 minutes of 30 s);
#: one still running then is cancelled and its job failed
HANDLER_LEASES_AT_MOST = 10
#: of a job whose stored item is not a job (corrupted, written by hand), the job DLQ keeps this much
UNREADABLE_KEPT = 4096
#: what ``retry_dead`` reports of each id
RETRIED, NOT_DEAD, SCHEDULED, UNREADABLE, CHANGED = "retried", "not dead", "scheduled", "unreadable", "changed"


@record
class Job:
    id: str
    kind: str
    payload: dict[str, Any]
    attempt: int
    token: str
    lane: str = ""  # "": the default lane; else the environment whose lane it is in


@record
class DeadJob:
    """An entry of the job DLQ as read. ``raw``: the entry as stored, so that it is acted on only
    while it is still that one. ``readable`` False: the entry is not a job's (a stored item the claim
    could not read, kept under ``item``; an entry written by hand): ``error`` says why, and it cannot
    be retried. ``dead_at`` (epoch s) None: written before entries carried it, not yet seen by
    retention (which stamps it with the time it first sees it)."""

    id: str
    kind: str
    lane: str
    attempt: int
    error: str
    dead_at: float | None
    payload: dict[str, Any]
    readable: bool
    raw: bytes


#: a job to create or replace: id, kind, payload, run-at (epoch s), lane ("": the default one)
JobSpec = tuple[str, str, dict[str, Any], float, str]


def _encode(kind: str, payload: dict[str, Any], attempt: int, token: str, lane: str,
            error: str | None = None, dead_at_ms: int | None = None) -> bytes:
    data: dict[str, Any] = {"kind": kind, "payload": payload, "attempt": attempt, "token": token}
    if lane:
        data["lane"] = lane
    if error is not None:
        data["error"] = error
    if dead_at_ms is not None:
        data["dead_at"] = dead_at_ms
    return orjson.dumps(data)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _decode(job_id: str | bytes, raw: str | bytes, lane: str | bytes | None = None) -> Job:
    """A job as stored; ``lane``: the lane it was claimed from (a job a process of the version
    before lanes wrote has none in its JSON). ValueError when ``raw`` is not a job."""
    data = orjson.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    kind, payload, attempt, token = data.get("kind"), data.get("payload"), data.get("attempt"), data.get("token")
    if not (isinstance(kind, str) and isinstance(payload, dict) and isinstance(token, str)
            and isinstance(attempt, int) and not isinstance(attempt, bool)):
        raise ValueError("not a job: kind, payload, attempt or token missing or of another type")
    return Job(_text(job_id), kind, payload, attempt, token,
               _text(lane) if lane is not None else str(data.get("lane", "")))


def _unreadable(raw: str | bytes, why: Exception, dead_at_ms: int) -> bytes:
    """What the job DLQ keeps of a job whose item is not one: no kind, the item as text, and why."""
    text = raw.decode(errors="backslashreplace") if isinstance(raw, bytes) else raw
    return orjson.dumps({"kind": "", "payload": {}, "attempt": 0, "token": "", "item": text[:UNREADABLE_KEPT],
                         "error": f"the stored job cannot be read ({why}); kept as it was in 'item'",
                         "dead_at": dead_at_ms})


def _dead(job_id: str | bytes, raw: str | bytes) -> DeadJob:
    """An entry of the job DLQ as :class:`DeadJob`, whatever it holds."""
    raw_b = raw.encode() if isinstance(raw, str) else raw
    try:
        data = orjson.loads(raw_b)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        return DeadJob(_text(job_id), "", "", 0, "the entry cannot be read: not a JSON object", None, {}, False, raw_b)
    at = data.get("dead_at")
    dead_at = at / 1000 if isinstance(at, int | float) and not isinstance(at, bool) else None
    error = str(data.get("error", ""))
    try:
        job = _decode(job_id, raw_b)
    except (ValueError, TypeError) as exc:
        return DeadJob(_text(job_id), str(data.get("kind", "")), str(data.get("lane", "")), 0,
                       f"the entry cannot be read ({exc})", dead_at, {}, False, raw_b)
    return DeadJob(job.id, job.kind, job.lane, job.attempt, error, dead_at, job.payload, job.kind != "", raw_b)


def _stamped(entry: DeadJob, now_ms: int) -> bytes:
    """``entry`` with the time of death ``now_ms`` (one that is not a JSON object is kept as text under
    'item', as an unreadable item is)."""
    try:
        data = orjson.loads(entry.raw)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        return _unreadable(entry.raw, ValueError("not a JSON object"), now_ms)
    return orjson.dumps({**data, "dead_at": now_ms})


class JobQueue:
    def __init__(self, redis: Redis, *, prefix: str, clock: Clock, max_attempts: int = 12,
                 min_retry_s: float = 1.0, max_retry_s: float = 3600.0, factor: float = 2.0) -> None:
        self.redis = redis
        self.clock = clock
        self.max_attempts = max_attempts
        self.min_retry_s = min_retry_s
        self.max_retry_s = max_retry_s
        self.factor = factor
        self.base = f"{prefix}:{{jobs}}"
        self.due_key = f"{self.base}:due"  # the default lane
        self.lanes_key = f"{self.base}:lanes"
        self.lane_of_key = f"{self.base}:lane_of"
        self.items_key = f"{self.base}:items"
        self.dlq_key = f"{self.base}:dlq"
        self.epoch_key = f"{self.base}:epoch"
        # since when this process has reached these jobs without a break: heartbeats (a job's
        # reschedule) sent to it before then may have been lost (it was not running, or Redis
        # was away), so a heartbeat timeout due within one timeout of it proves nothing yet
        self.heard_since = clock.now()
        self._cut_off = False
        self._reschedule = LuaScript.get("jobs_reschedule")
        self._claim = LuaScript.get("jobs_claim")
        self._settle = LuaScript.get("jobs_settle")
        self._apply = LuaScript.get("jobs_apply")
        self._find = LuaScript.get("jobs_find")
        self._stats = LuaScript.get("jobs_stats")
        self._dlq_script = LuaScript.get("jobs_dlq")
        # the settles of jobs finishing together go in one call
        self._settles: Batcher[tuple[str, str | bytes, str, bytes | str, int], bool] = Batcher(self._settle_many)

    def _ms(self, when: float) -> int:
        return int(when * 1000)

    def lane_key(self, lane: str) -> str:
        return self.due_key if lane == "" else f"{self.base}:lane:{lane}"

    async def _call(self, script: LuaScript, args: Sequence[Any]) -> Any:
        try:
            out = await script(self.redis, [self.items_key], [self.base, *args])
        except Exception as exc:
            if unavailable_dependency(exc) is not None:
                self._cut_off = True
            raise
        if self._cut_off:  # Redis is back: heartbeats could not be recorded until now
            self._cut_off = False
            self.heard_since = self.clock.now()
        return out

    async def schedule(self, job_id: str, kind: str, payload: dict[str, Any], run_at: float, lane: str = "") -> None:
        await self.apply((), [(job_id, kind, payload, run_at, lane)])

    async def apply(self, cancel: Sequence[str], schedule: Sequence[JobSpec]) -> None:
        """Cancel ``cancel`` and create or replace ``schedule`` in one round trip (cancels first,
        so an id in both ends up scheduled)."""
        if not cancel and not schedule:
            return
        args: list[Any] = [self._ms(self.clock.now()), len(cancel), *cancel]
        for job_id, kind, payload, run_at, lane in schedule:
            args += [job_id, self._ms(run_at), lane, _encode(kind, payload, 0, secrets.token_hex(8), lane)]
        await self._call(self._apply, args)

    async def reschedule(self, job_id: str, run_at: float) -> bool:
        return (await self.reschedule_many([(job_id, run_at)]))[0]

    async def reschedule_many(self, items: Sequence[tuple[str, float]]) -> list[bool]:
        if not items:
            return []
        args: list[Any] = [self._ms(self.clock.now())]
        for job_id, run_at in items:
            args += [job_id, self._ms(run_at)]
        return [bool(x) for x in await self._call(self._reschedule, args)]

    async def ack(self, job_id: str) -> None:
        await self.apply([job_id], ())

    async def claim(self, limit: int, visibility_s: float = 30.0, *, lane_room: int | None = None,
                    lane_cap: int | None = None, in_flight: Mapping[str, int] | None = None) -> list[Job]:
        """Lease up to ``limit`` due jobs: the default lane's first, then the lanes' in turn, at
        most ``lane_room`` of theirs and none of a lane with ``lane_cap`` jobs ``in_flight``."""
        args: list[Any] = [self._ms(self.clock.now()), limit, int(visibility_s * 1000),
                           -1 if lane_room is None else lane_room, -1 if lane_cap is None else lane_cap]
        for lane, n in (in_flight or {}).items():
            if lane:
                args += [lane, n]
        flat = await self._call(self._claim, args)
        jobs: list[Job] = []
        unreadable: list[tuple[bytes | str, bytes | str, Exception]] = []
        for i in range(0, len(flat), 3):
            try:
                jobs.append(_decode(flat[i], flat[i + 1], flat[i + 2]))
            except (ValueError, TypeError) as exc:  # (orjson's decode error is a ValueError)
                unreadable.append((flat[i], flat[i + 1], exc))
        if unreadable:
            await self._bury(unreadable)
        return jobs

    async def _bury(self, items: list[tuple[bytes | str, bytes | str, Exception]]) -> None:
        """Move jobs whose items are not jobs to the job DLQ (each only if its item is still the one
        read): one must not fail every claim that takes it, and with it the jobs claimed beside it.
        Should this fail (Redis away), their leases run out and the next claim tries again."""
        for job_id, _, exc in items:
            log.error("engine job %s: its stored item cannot be read (%s); moved to the job DLQ", _text(job_id), exc)
        now_ms = self._ms(self.clock.now())
        try:
            await asyncio.gather(*(self._settles.submit((_text(job_id), raw, "bury", _unreadable(raw, exc, now_ms), 0))
                                   for job_id, raw, exc in items))
        except Exception as exc:
            log_failure(log, exc, "%d unreadable engine jobs could not be moved to the job DLQ", len(items))

    async def _settle_many(self, settles: list[tuple[str, str | bytes, str, bytes | str, int]]) -> list[bool]:
        return [bool(x) for x in await self._call(self._settle, [field for s in settles for field in s])]

    async def complete(self, job: Job) -> bool:
        return await self._settles.submit((job.id, job.token, "complete", "", 0))

    def retry_delay_s(self, attempt: int) -> float:
        return min(self.max_retry_s, self.min_retry_s * self.factor ** max(0, attempt - 1))

    async def fail(self, job: Job, error: str) -> bool:
        """Retry the job after a back-off, or move it to the job DLQ after ``max_attempts``."""
        attempt = job.attempt + 1
        if attempt >= self.max_attempts:
            dead = _encode(job.kind, job.payload, attempt, job.token, job.lane, error, self._ms(self.clock.now()))
            return await self._settles.submit((job.id, job.token, "dead", dead, 0))
        encoded = _encode(job.kind, job.payload, attempt, job.token, job.lane, error)
        run_at = self.clock.now() + self.retry_delay_s(attempt)
        return await self._settles.submit((job.id, job.token, "retry", encoded, self._ms(run_at)))

    async def extend(self, job: Job, until: float) -> bool:
        """Move the lease of a claimed job to ``until``; False when the job was replaced or is gone."""
        return (await self._settle_many([(job.id, job.token, "extend", "", self._ms(until))]))[0]

    async def release(self, job: Job, run_at: float) -> bool:
        """Put a claimed job back as it was (same attempt, same token) to run at ``run_at``."""
        encoded = _encode(job.kind, job.payload, job.attempt, job.token, job.lane)
        return await self._settles.submit((job.id, job.token, "retry", encoded, self._ms(run_at)))

    async def _found(self, job_ids: Sequence[str]) -> list[tuple[Any, str]]:
        """(run-at ms or None, lane) of each job (one round trip)."""
        flat = await self._call(self._find, job_ids) if job_ids else []
        return [(flat[i], _text(flat[i + 1])) for i in range(0, len(flat), 2)]

    async def missing(self, job_ids: Sequence[str]) -> list[str]:
        """Those of ``job_ids`` that are not scheduled (one round trip)."""
        found = await self._found(job_ids)
        return [j for j, (score, _) in zip(job_ids, found, strict=True) if score is None]

    async def misplaced(self, jobs: Sequence[tuple[str, str]]) -> list[str]:
        """Of ``(id, lane)`` pairs, the ids not scheduled in that lane: missing, or in another (a
        job a version before lanes scheduled is in the default one)."""
        found = await self._found([job_id for job_id, _ in jobs])
        return [job_id for (job_id, lane), (score, where) in zip(jobs, found, strict=True)
                if score is None or where != lane]

    async def get(self, job_id: str) -> tuple[Job, float] | None:
        [(score, _)] = await self._found([job_id])
        raw = await self.redis.hget(self.items_key, job_id)
        if raw is None or score is None:
            return None
        return _decode(job_id, raw), float(score) / 1000

    async def dlq(self, limit: int = 100) -> list[tuple[Job, str]]:
        """Up to ``limit`` entries of the job DLQ as jobs with their errors (an entry that is not a
        job's as an empty one)."""
        out: list[tuple[Job, str]] = []
        cursor = 0
        while len(out) < limit:
            cursor, page = await self.dead_page(cursor, limit)
            out += [(Job(d.id, d.kind, d.payload, d.attempt, "", d.lane), d.error) for d in page]
            if cursor == 0:
                break
        return out[:limit]

    async def dead_page(self, cursor: int = 0, count: int = 100) -> tuple[int, list[DeadJob]]:
        """One HSCAN page of the job DLQ from ``cursor`` (0: the start), about ``count`` entries
        (Redis's hint: a small hash comes whole), in no order; the cursor to go on from (0: through).
        An entry present throughout a walk is met at least once (twice at most, should Redis rehash)."""
        next_cursor, page = await self.redis.hscan(self.dlq_key, cursor, count=count)
        assert isinstance(page, dict)  # (without no_values)
        return int(next_cursor), [_dead(job_id, raw) for job_id, raw in page.items()]

    async def dead_count(self) -> int:
        return int(await self.redis.hlen(self.dlq_key))

    async def _act_on_dead(self, acts: Sequence[tuple[str, str, bytes, bytes, str]]) -> list[int]:
        """jobs_dlq.lua's (id, action, entry as read, new JSON, lane) quintuples, in one call."""
        if not acts:
            return []
        args: list[Any] = [self._ms(self.clock.now())]
        for act in acts:
            args += act
        return [int(x) for x in await self._call(self._dlq_script, args)]

    async def retry_entries(self, entries: Sequence[DeadJob]) -> list[str]:
        """Put these dead jobs back to run now, attempts reset and a new token, each taken out of the
        job DLQ atomically and only while its entry is the one read: RETRIED, SCHEDULED (a job of
        its id is scheduled already: left as it is, the dead copy dropped), CHANGED (the entry is
        gone or is another now), or UNREADABLE (not a job's: left, to be dropped)."""
        acts = [(d.id, "retry", d.raw, _encode(d.kind, d.payload, 0, secrets.token_hex(8), d.lane), d.lane)
                for d in entries if d.readable]
        done = iter(await self._act_on_dead(acts))
        outcome = {0: CHANGED, 1: RETRIED, 2: SCHEDULED}
        return [outcome[next(done)] if d.readable else UNREADABLE for d in entries]

    async def retry_dead(self, job_ids: Sequence[str]) -> list[str]:
        """:meth:`retry_entries` of these ids as their entries are now; NOT_DEAD for an id the job DLQ
        does not hold (retried or dropped already: retrying twice does it once). An entry written
        again between the read and the move (the job died again) is read again."""
        outcomes: dict[str, str] = {}
        todo = list(dict.fromkeys(job_ids))
        for _ in range(3):
            if not todo:
                break
            raws = await self.redis.hmget(self.dlq_key, todo)
            present = [_dead(job_id, raw) for job_id, raw in zip(todo, raws, strict=True) if raw is not None]
            outcomes.update({job_id: NOT_DEAD for job_id, raw in zip(todo, raws, strict=True) if raw is None})
            results = await self.retry_entries(present)
            outcomes.update({d.id: r for d, r in zip(present, results, strict=True)})
            todo = [d.id for d, r in zip(present, results, strict=True) if r == CHANGED]
        return [outcomes[job_id] for job_id in job_ids]

    async def drop_dead(self, job_ids: Sequence[str]) -> list[bool]:
        """Delete these entries of the job DLQ (one call); False for an id it does not hold."""
        done = await self._act_on_dead([(job_id, "forget", b"", b"", "") for job_id in job_ids])
        return [bool(x) for x in done]

    async def trim_dead(self, cursor: int, count: int, older_than: float) -> tuple[int, int, int]:
        """One page of retention's walk of the job DLQ (:meth:`dead_page`): the entries that died
        before ``older_than`` (epoch s) are deleted, each only while it is the one read; one that
        carries no time of death (written before entries did) is stamped with now, so that it goes
        a retention later. Returns (the cursor to go on from, 0: through; deleted; stamped)."""
        next_cursor, page = await self.dead_page(cursor, count)
        now_ms = self._ms(self.clock.now())
        acts = [(d.id, "drop", d.raw, b"", "") for d in page if d.dead_at is not None and d.dead_at < older_than]
        dropped = len(acts)
        acts += [(d.id, "stamp", d.raw, _stamped(d, now_ms), "") for d in page if d.dead_at is None]
        done = await self._act_on_dead(acts)
        return next_cursor, sum(done[:dropped]), sum(done[dropped:])

    async def size(self) -> int:
        return int(await self.redis.hlen(self.items_key))

    async def lanes(self) -> list[str]:
        """The lanes other than the default one that are listed (to be looked at)."""
        members = await self.redis.zrange(self.lanes_key, 0, -1)
        return [m.decode() if isinstance(m, bytes) else str(m) for m in members]

    async def epoch(self) -> float | None:
        """None when Redis lost the jobs' data (a flush, or a restart without persistence, of the
        node holding them: on a Redis Cluster not always the one holding the run queue): the
        reconciler then re-arms every job from PostgreSQL and calls :meth:`mark_epoch`; likewise
        when the key holds what is not an epoch. Else when it is to look at every job once more
        (0: never; see :mod:`run_engine.epochs`)."""
        value = await self.redis.get(self.epoch_key)
        return None if value is None else recheck_time(value, self.epoch_key)  # unreadable: None too

    async def has_epoch(self) -> bool:
        return await self.epoch() is not None

    async def mark_epoch(self, recheck_at: float | None = None) -> None:
        """The jobs are restored; with ``recheck_at``, to be looked at once more from then on."""
        await self.redis.set(self.epoch_key, epoch_value(recheck_at))

    async def stats(self) -> tuple[int, float, int]:
        """(jobs scheduled, seconds the oldest due job is late, jobs in the job DLQ), one round trip.
        A claimed job's score is its lease's end, so only jobs nobody has taken count as late."""
        now = self.clock.now()
        scheduled, oldest, dead = await self._call(self._stats, [self._ms(now)])
        lag = max(0.0, now - float(oldest) / 1000) if oldest is not None else 0.0
        return int(scheduled), lag, int(dead)


Handler = Callable[[Job], Awaitable[None]]


class JobWorker:
    """Claims due jobs and runs their handlers, ``concurrency`` at a time.

    A quarter of the slots (one at least) are the default lane's alone: the checks of held runs
    never wait for slots that environments' jobs hold. Of the others, one lane holds a third at
    most: a tenant whose jobs are slow (a bulk action's pages) cannot take them all.

    A handler keeps its job's lease while it runs (moved a lease on every third of one), so that no
    other process takes a job merely slow and runs it beside it; for ``handler_timeout_s`` at most
    (HANDLER_LEASES_AT_MOST leases): one still running then is cancelled and its job failed (tried
    again after its back-off, and dead-lettered after its attempts). A handler that hangs (a
    statement behind a lock never released, a Redis call never answered) held its slot for ever
    before, and, once its lease ran out, the slot of each next process that took the job."""

    def __init__(self, queue: JobQueue, handlers: Mapping[str, Handler], *, concurrency: int = 10,
                 poll_interval_s: float = 0.05, visibility_s: float = 30.0) -> None:
        self.queue = queue
        self.handlers = dict(handlers)
        self.concurrency = concurrency
        self.poll_interval_s = poll_interval_s
        self.visibility_s = visibility_s
        self.handler_timeout_s = visibility_s * HANDLER_LEASES_AT_MOST
        self.reserved = max(1, concurrency // 4) if concurrency > 1 else 0
        self.lane_slots = concurrency - self.reserved
        self.lane_cap = max(1, self.lane_slots // 3)
        self._task: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        self._in_flight: dict[str, int] = {}  # lane -> its jobs running here
        self._unknown_kinds: set[str] = set()  # kinds met without a handler (logged once each)
        self._stopping = False

    async def _run(self, job: Job) -> None:
        handler = self.handlers.get(job.kind)
        if handler is None:  # a newer version's kind: not a failure of the job, nor an attempt
            if job.kind not in self._unknown_kinds:
                self._unknown_kinds.add(job.kind)
                log.warning("engine job %s: no handler for its kind %r in this process (an older version?); "
                            "it is put back for a process that knows it", job.id, job.kind)
            try:
                await self.queue.release(job, self.queue.clock.now() + UNKNOWN_KIND_DELAY_S)
            except Exception as exc:  # its lease runs out and it is delivered again
                log_failure(log, exc, "engine job %s (%s) could not be put back", job.id, job.kind)
            return
        bound = asyncio.timeout(self.handler_timeout_s)
        keeper = asyncio.create_task(self._keep_lease(job))
        try:
            async with bound:
                await handler(job)
        except Exception as exc:
            if isinstance(exc, TimeoutError) and bound.expired():
                log.error("engine job %s (%s) cancelled: still running after %.1f s; it is tried again later",
                          job.id, job.kind, self.handler_timeout_s)
                error = f"cancelled: still running after {self.handler_timeout_s:.1f} s"
            else:
                log_failure(log, exc, "engine job %s (%s) failed", job.id, job.kind)
                error = f"{type(exc).__name__}: {exc}"
            settle = self.queue.fail(job, error)
        else:
            settle = self.queue.complete(job)
        finally:
            keeper.cancel()
        try:
            await settle
        except Exception as exc:  # its lease runs out and it is delivered again
            log_failure(log, exc, "engine job %s (%s) could not be settled", job.id, job.kind)

    async def _keep_lease(self, job: Job) -> None:
        """Move the job's lease a lease on every third of one, until the job is replaced or gone."""
        while True:
            await asyncio.sleep(self.visibility_s / 3)
            try:
                if not await self.queue.extend(job, self.queue.clock.now() + self.visibility_s):
                    return
            except Exception as exc:  # Redis away: the next tick tries again, else the lease runs out
                log_failure(log, exc, "engine job %s (%s): its lease could not be kept", job.id, job.kind)

    async def run_due_once(self) -> int:
        """Claim and run every job due now; returns how many ran."""
        total = 0
        while True:
            jobs = await self.queue.claim(self.concurrency, self.visibility_s)
            if not jobs:
                return total
            await asyncio.gather(*(self._run(job) for job in jobs))
            total += len(jobs)

    def _started(self, job: Job) -> None:
        self._in_flight[job.lane] = self._in_flight.get(job.lane, 0) + 1
        task = asyncio.create_task(self._run(job))
        self._running.add(task)
        task.add_done_callback(functools.partial(self._finished, job.lane))

    def _finished(self, lane: str, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        left = self._in_flight.get(lane, 0) - 1
        if left > 0:
            self._in_flight[lane] = left
        else:
            self._in_flight.pop(lane, None)

    async def _loop(self) -> None:
        backoff = 0.0
        while not self._stopping:
            free = self.concurrency - len(self._running)
            if free <= 0:  # every slot busy: claim again as soon as one frees (not a poll later)
                await asyncio.wait(self._running, timeout=self.poll_interval_s, return_when=asyncio.FIRST_COMPLETED)
                continue
            lanes_busy = len(self._running) - self._in_flight.get("", 0)
            try:
                jobs = await self.queue.claim(free, self.visibility_s, lane_room=max(0, self.lane_slots - lanes_busy),
                                              lane_cap=self.lane_cap, in_flight=self._in_flight)
                if backoff:
                    log.info("claiming engine jobs works again")
                    backoff = 0.0
            except Exception as exc:  # Redis away: keep trying (backing off), the jobs are still there
                if not backoff:
                    log_failure(log, exc, "claiming engine jobs failed")
                backoff = min(2.0, max(0.1, backoff * 2))
                await asyncio.sleep(backoff)
                continue
            for job in jobs:
                self._started(job)
            if len(jobs) < free:  # nothing more due now, or none the slots free now may take
                if self._running:  # claim again when a job ends (it may free a lane's room), or after a poll
                    await asyncio.wait(self._running, timeout=self.poll_interval_s,
                                       return_when=asyncio.FIRST_COMPLETED)
                else:
                    await asyncio.sleep(self.poll_interval_s)

    async def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(self._loop(), name="engine-jobs")

    async def stop(self) -> None:
        task, self._task = self._task, None
        self._stopping = True
        await stop_task(task)
        if self._running:
            await asyncio.wait(self._running, timeout=30)
