"""Reconciler and retention: the leader's housekeeping (DESIGN §6, §8).

PostgreSQL is the system of record; the Redis queue is rebuilt from it when they disagree:
* a run whose latest snapshot is QUEUED (or QUEUED_EXECUTING) but which the queue does not know
  (a Redis restart or flush) is enqueued again at its original place;
* such a run the queue holds as handed out although PostgreSQL never saw the dequeue (the process
  died between the two) is made ready again;
* a DELAYED run whose date passed long ago (its engine job was lost with Redis) is enqueued;
* a slot held by a run that is finished or suspended (its ack was lost) is freed.
Retention deletes finished runs (with their snapshots, journals and checkpoints) and completed
waitpoints older than the configured age, in batches.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from run_engine.statuses import ExecutionStatus
from systems.resources import SystemResources

log = logging.getLogger(__name__)
E = ExecutionStatus
#: execution statuses in which a run legitimately holds a queue slot
HOLDS_SLOT = frozenset({E.PENDING_EXECUTING, E.EXECUTING, E.EXECUTING_WITH_WAITPOINTS, E.PENDING_CANCEL,
                        E.QUEUED, E.QUEUED_EXECUTING})  # queued ones only for the instant of a dequeue


@dataclass
class ReconcileReport:
    requeued_missing: int = 0
    requeued_stuck: int = 0
    delayed_enqueued: int = 0
    slots_freed: int = 0
    settings_restored: int = 0


class Reconciler:
    PAGE = 500

    def __init__(self, resources: SystemResources) -> None:
        self.r = resources

    @property
    def _s(self):  # type: ignore[no-untyped-def]
        assert self.r.systems is not None
        return self.r.systems

    async def reconcile(self, grace_s: float | None = None) -> ReconcileReport:
        """One pass; ``grace_s`` (default the setting) skips runs touched more recently than that,
        which an ordinary enqueue or dequeue may still be finishing."""
        grace = self.r.settings.reconcile_grace_s if grace_s is None else grace_s
        report = ReconcileReport()
        if not await self.r.queue.has_epoch():
            # Redis lost its data (or is new): limits, pauses and rate limits first, then the runs
            report.settings_restored = await self._restore_settings()
            await self.r.queue.mark_epoch()
        await self._queued_runs(grace, report)
        for run_id in await self.r.repo.due_delayed_runs(grace, self.PAGE):
            await self._s.delayed.enqueue_delayed(run_id)
            report.delayed_enqueued += 1
        await self._slots(report)
        if report.requeued_missing or report.requeued_stuck or report.delayed_enqueued or report.slots_freed:
            log.warning("reconciler repaired the queue: %s", report)
        return report

    async def _restore_settings(self) -> int:
        envs = await self.r.repo.environment_ids()
        for env_id in envs:
            row = await self.r.repo.environment(env_id)
            if row is not None:
                await self.r.queue.set_env_limit(env_id, row["concurrency_limit"])
            await self._s.enqueue.mirror_queues(env_id)
        return len(envs)

    async def _queued_runs(self, grace: float, report: ReconcileReport) -> None:
        after = ""
        while True:
            runs = await self.r.repo.queued_runs_page(after, grace, self.PAGE)
            if not runs:
                return
            after = runs[-1].id
            states = await self.r.queue.message_states([(r.environment_id, r.id) for r in runs])
            suspect = [(run, state) for run, state in zip(runs, states, strict=True) if state in (None, "held")]
            if suspect:
                await asyncio.gather(*(self._requeue(run, state, report) for run, state in suspect))

    async def _requeue(self, run, state, report: ReconcileReport) -> None:  # type: ignore[no-untyped-def]
        async with self.r.locker.lock("reconcile", run.id):
            latest = await self.r.repo.latest_snapshot(run.id)
            if latest is None or latest.engine_status not in (E.QUEUED, E.QUEUED_EXECUTING):
                return  # moved on meanwhile
            current = (await self.r.queue.message_states([(run.environment_id, run.id)]))[0]
            if current != state:
                return
            await self.r.enqueue_items([self._s.enqueue.item_for(run, reset_deliveries=state is None)])
        if state is None:
            report.requeued_missing += 1
        else:
            report.requeued_stuck += 1

    async def _slots(self, report: ReconcileReport) -> None:
        for env_id in await self.r.repo.environment_ids():
            holding = sorted(await self.r.queue.running_ids(env_id))
            for start in range(0, len(holding), self.PAGE):
                page = holding[start:start + self.PAGE]
                statuses = await self.r.repo.slot_holders(page)
                stale = [rid for rid in page if statuses.get(rid) not in HOLDS_SLOT]
                if stale:
                    await self.r.queue.ack([(env_id, rid) for rid in stale])
                    report.slots_freed += len(stale)

    async def retention(self) -> int:
        """Delete what finished more than ``retention_s`` ago, a batch at a time."""
        age = self.r.settings.retention_s
        if age is None:
            return 0
        total = 0
        while True:
            deleted = await self.r.repo.delete_finished_before(age, self.r.settings.retention_batch)
            total += deleted
            if deleted < self.r.settings.retention_batch:
                break
            await asyncio.sleep(0.05)  # leave room for the hot path between batches
        if total:
            log.info("retention: deleted %d rows older than %.0f s", total, age)
        return total
