"""DebounceSystem: triggers with ``debounce {key, delay, mode, maxDelay}`` (Trigger.dev's debounce).

The first trigger of (environment, task, key) creates a DELAYED run due in ``delay``; each later
one while that run is still DELAYED joins it instead (the same run id, ``is_cached``) and pushes
its date to now + ``delay``, never past the first trigger + ``maxDelay`` (default: the longer of
``delay`` and :data:`DEFAULT_MAX_DELAY_S`). Mode "trailing" also gives the run the latest
trigger's payload (and metadata, tags, max attempts, max duration, machine when given). Once the
run has left DELAYED (enqueued, started, cancelled, expired), the next trigger starts a new run.
An idempotency key is checked first: a run holding it is the answer, debounced or not.

Races: the unique partial index ``task_run_debounce_uq`` (environment, task, key) WHERE DELAYED
makes concurrent first triggers, in any number of processes, insert one run (``ON CONFLICT DO
NOTHING``; the others find it and join it). Joining takes the run lock and updates the row only
``WHERE status = 'DELAYED'``; the delay job takes the same lock and re-reads the date, so a run
is either joined (and its job moved) or enqueued, never both half-way.

Triggers without ``debounce`` go straight to :meth:`EnqueueSystem.trigger_many`: nothing more is
read or written for them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import cast

from run_engine.db.runs import DebounceReplacement
from run_engine.errors import ConflictError, ValidationError
from run_engine.statuses import RunStatus
from systems.delayed_runs import DelayedRunsSystem
from systems.enqueue import EnqueueSystem, TriggeredRun, TriggerRequest
from systems.resources import SystemResources

#: without ``maxDelay``, a debounced run is pushed back at most this long after its first trigger
#: (or its ``delay``, when that is longer), so that a steady stream of triggers cannot starve it
DEFAULT_MAX_DELAY_S = 3600.0
MAX_KEY_LENGTH = 512
MODES = ("leading", "trailing")
#: look-ups and inserts one trigger may take when the key keeps changing hands under it
ATTEMPTS = 8


class DebounceSystem:
    def __init__(self, resources: SystemResources, *, enqueue: EnqueueSystem,
                 delayed_runs: DelayedRunsSystem) -> None:
        self.r = resources
        self.enqueue = enqueue
        self.delayed_runs = delayed_runs

    async def trigger_many(self, requests: Sequence[TriggerRequest]) -> list[TriggeredRun]:
        """Create runs (or join debounced ones), answers in the requests' order: the requests
        without ``debounce`` in one :meth:`EnqueueSystem.trigger_many` call, then each debounced
        one (in order, so two items of one batch with one key make one run). A debounced one that
        fails raises, the runs made before it standing (see :meth:`trigger_each`)."""
        return cast(list[TriggeredRun], await self._trigger(requests, each=False))

    async def trigger_each(self, requests: Sequence[TriggerRequest]) -> list[TriggeredRun | Exception]:
        """:meth:`trigger_many`, each debounced item's failure answered in its place instead of
        raised: it comes after the plain items' runs were committed (its run's lock busy, its key
        changing hands, an outage), so a caller that answers per item does not fail them with it.
        A refusal found before any run is made (every item is checked first) still raises."""
        return await self._trigger(requests, each=True)

    async def _trigger(self, requests: Sequence[TriggerRequest], *, each: bool) -> list[TriggeredRun | Exception]:
        for req in requests:
            if req.debounce is not None:
                break
        else:
            return list(await self.enqueue.trigger_many(requests))
        for req in requests:  # every item checked before any is created (a refusal creates nothing)
            await self.check(req)
        plain = [i for i, req in enumerate(requests) if req.debounce is None]
        out: dict[int, TriggeredRun | Exception] = {}
        if plain:
            out.update(zip(plain, await self.enqueue.trigger_many([requests[i] for i in plain]), strict=True))
        for i, req in enumerate(requests):
            if req.debounce is not None:
                try:
                    out[i] = await self.trigger(req)
                except Exception as exc:
                    if not each:
                        raise
                    out[i] = exc
        return [out[i] for i in range(len(requests))]

    async def check(self, req: TriggerRequest) -> None:
        """Refuse now what triggering ``req`` would refuse, creating no run (a queue it names is made)."""
        self.validate(req)
        await self.enqueue.check(req)

    async def trigger(self, req: TriggerRequest) -> TriggeredRun:
        """One debounced trigger: the run holding its idempotency key, else the DELAYED run of its
        debounce key (joined), else a new DELAYED run."""
        d = req.debounce
        if d is None:
            return (await self.enqueue.trigger_many([req]))[0]
        self.validate(req)
        for _ in range(ATTEMPTS):
            now = self.r.clock.now()
            if req.idempotency_key is not None and (held := await self._idempotent(req, now)) is not None:
                return held
            when = datetime.fromtimestamp(now + d.delay_s, UTC)
            existing = await self.r.repo.runs.delayed_run_by_debounce_key(req.env_id, req.task_id, d.key)
            if existing is not None:
                joined = await self.delayed_runs.debounce(existing.id, when, self._replacement(req))
                if joined is not None:
                    return TriggeredRun(joined.id, RunStatus.DELAYED, "", joined.queue, is_cached=True)
                continue  # it left DELAYED meanwhile: the next look finds another run or none
            cap = d.max_delay_s if d.max_delay_s is not None else max(d.delay_s, DEFAULT_MAX_DELAY_S)
            created = await self.enqueue.create_debounced(dataclasses.replace(req, delay_until=when),
                                                          datetime.fromtimestamp(now + cap, UTC))
            if created is not None:
                return created
            # a concurrent trigger inserted first (this key or the idempotency key): look again
        raise ConflictError("debounce.key", "the key kept changing hands during this trigger; retry")

    @staticmethod
    def validate(req: TriggerRequest) -> None:
        d = req.debounce
        if d is None:
            return
        if not d.key or len(d.key) > MAX_KEY_LENGTH:
            raise ValidationError("debounce.key", f"must be 1..{MAX_KEY_LENGTH} characters")
        if not d.delay_s >= 1:
            raise ValidationError("debounce.delay", "must be at least 1 second")
        if d.mode not in MODES:
            raise ValidationError("debounce.mode", "must be 'leading' or 'trailing'")
        if d.max_delay_s is not None and not d.max_delay_s >= d.delay_s:
            raise ValidationError("debounce.maxDelay", "must be at least the delay")

    async def _idempotent(self, req: TriggerRequest, now: float) -> TriggeredRun | None:
        """The run holding the request's idempotency key (once expired keys are released), if any."""
        key = (req.task_id, req.idempotency_key or "")
        await self.r.repo.runs.release_expired_idempotency_keys(req.env_id, [(*key, req.batch_id)],
                                                                datetime.fromtimestamp(now, UTC))
        holder = (await self.r.repo.runs.runs_by_idempotency_key(req.env_id, [key])).get(key)
        if holder is None:
            return None
        return TriggeredRun(holder.id, RunStatus(holder.status), "", holder.queue, is_cached=True)

    @staticmethod
    def _replacement(req: TriggerRequest) -> DebounceReplacement | None:
        """What a trailing trigger changes on the run it joins; None for a leading one."""
        if req.debounce is None or req.debounce.mode != "trailing":
            return None
        return DebounceReplacement(
            payload=req.payload, payload_type=req.payload_type, metadata=req.metadata, tags=req.tags or None,
            max_attempts=req.max_attempts, max_duration_s=req.max_duration_s, machine=req.machine)
