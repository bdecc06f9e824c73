"""WaitingForWorkerSystem: runs of a task that no deployment has wait as PENDING_VERSION; when a
deployment with the task registers, they are enqueued (keeping their place in the queue)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from run_engine.db.repository import Transition
from run_engine.events import RunEvent
from run_engine.ids import new_id
from run_engine.statuses import ExecutionStatus, RunStatus
from systems.resources import SystemResources

if TYPE_CHECKING:
    from systems.enqueue import EnqueueSystem
    from systems.schedules import SchedulesSystem

E = ExecutionStatus
BATCH = 200


class WaitingForWorkerSystem:
    def __init__(self, resources: SystemResources, *, enqueue: EnqueueSystem, schedules: SchedulesSystem) -> None:
        self.r = resources
        self.enqueue = enqueue
        self.schedules = schedules

    async def register_deployment(
        self, *, env_id: str, worker_group_id: str, version: str, content_hash: str,
        tasks: Sequence[dict[str, Any]], queues: Sequence[dict[str, Any]],
    ) -> tuple[str, int]:
        """Record the deployment (current from now on), mirror its queue limits into the run
        queue and enqueue the runs that were waiting for it. Returns (deployment id, runs enqueued)."""
        task_list = [{**t, "queue": t.get("queue") or f"task/{t['id']}"} for t in tasks]
        declared = {q["name"]: q for q in queues}
        for t in task_list:
            declared.setdefault(t["queue"], {"name": t["queue"], "type": "task"})
        queue_list = list(declared.values())
        dep_id, _ = await self.r.repo.register_deployment(
            deployment_id=new_id("deployment"), env_id=env_id, worker_group_id=worker_group_id,
            version=version, content_hash=content_hash, tasks=task_list, queues=queue_list,
            queue_ids=[new_id("queue") for _ in queue_list],
        )
        await self.enqueue.mirror_queues(env_id)
        self.enqueue.invalidate()
        await self.schedules.sync_declarative(env_id, list(tasks))
        waiting = await self.r.repo.pending_version_runs(env_id, worker_group_id, [t["id"] for t in task_list])
        queue_of = {t["id"]: t["queue"] for t in task_list}
        enqueued = 0
        for start in range(0, len(waiting), BATCH):
            enqueued += await self._promote(waiting[start:start + BATCH], dep_id, queue_of)
        return dep_id, enqueued

    async def _promote(self, run_ids: list[str], deployment_id: str, queue_of: dict[str, str]) -> int:
        async with self.r.locker.lock("pending_version", *run_ids):
            await self.r.repo.assign_deployment(run_ids, deployment_id, queue_of)
            results = await self.r.repo.transition_many([
                Transition(run_id=rid, new_snapshot_id=new_id("snapshot"), engine_status=E.QUEUED,
                           run_status=RunStatus.QUEUED, from_statuses=(E.PENDING_VERSION,),
                           description="A deployment with this task registered")
                for rid in run_ids
            ])
            runs = [res.run for res in results if res.applied and res.run is not None]
            if runs:
                await self.r.enqueue_items([self.enqueue.item_for(run) for run in runs])
        for run, res in zip(runs, [x for x in results if x.applied], strict=True):
            assert res.snapshot is not None
            self.r.events.emit(RunEvent("run_requeued", run.id, run.environment_id, res.snapshot.id,
                                        {"reason": "deployment"}))
        return len(runs)
