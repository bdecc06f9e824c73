"""DequeueSystem: take runs off the queue for a worker group and mark them PENDING_EXECUTING.

One Lua call takes up to ``max_runs`` runs; one lock call and one statement move them all."""

from __future__ import annotations

from dataclasses import dataclass

from run_engine.db.repository import RunRow, Snapshot, Transition
from run_engine.events import RunEvent
from run_engine.ids import new_id
from run_engine.run_queue import Handed
from run_engine.statuses import DEQUEUEABLE, ExecutionStatus, RunStatus
from systems.execution_snapshot import HEARTBEAT_JOB, heartbeat_job_id
from systems.resources import SystemResources


@dataclass(frozen=True, slots=True)
class DequeuedRun:
    run: RunRow
    snapshot: Snapshot
    deliveries: int


class DequeueSystem:
    def __init__(self, resources: SystemResources) -> None:
        self.r = resources

    async def dequeue(self, worker_group_id: str, max_runs: int, worker_id: str | None = None) -> Handed:
        """Up to ``max_runs`` runs as :class:`DequeuedRun`; the result's ``retry_at_ms`` says when a
        rate-limited queue of the group may serve again."""
        assert self.r.systems is not None
        messages = await self.r.queue.dequeue(worker_group_id, max_runs, self.r.now_ms())
        if not messages:
            return messages
        run_ids = [m.run_id for m in messages]
        froms = tuple(DEQUEUEABLE)
        async with self.r.locker.lock("dequeue", *run_ids):
            results = await self.r.repo.transition_many(
                [
                    Transition(
                        run_id=m.run_id,
                        new_snapshot_id=new_id("snapshot"),
                        engine_status=ExecutionStatus.PENDING_EXECUTING,
                        run_status=RunStatus.DEQUEUED,
                        from_statuses=froms,
                        description="Dequeued by a worker",
                        worker_id=worker_id,
                    )
                    for m in messages
                ]
            )
            dequeued: list[DequeuedRun] = []
            stray: list[tuple[str, str]] = []
            for message, result in zip(messages, results, strict=True):
                if result.applied and result.snapshot is not None and result.run is not None:
                    dequeued.append(DequeuedRun(result.run, result.snapshot, message.deliveries))
                else:
                    # The run moved on (finished, cancelled) while its message was queued: drop it.
                    stray.append((message.env_id, message.run_id))
            if stray:
                await self.r.queue.ack(stray)
            timeout = self.r.settings.pending_executing_timeout_s
            await self.r.jobs.schedule_many(
                [
                    (heartbeat_job_id(d.run.id, d.snapshot.id), HEARTBEAT_JOB,
                     {"run_id": d.run.id, "snapshot_id": d.snapshot.id}, self.r.clock.now() + timeout)
                    for d in dequeued
                ]
            )
        for d in dequeued:
            self.r.events.emit(RunEvent("run_dequeued", d.run.id, d.run.environment_id, d.snapshot.id))
        out = Handed(dequeued)
        out.retry_at_ms = messages.retry_at_ms
        return out
