"""WaitingForWorkerSystem: runs of a task that no deployment has wait as PENDING_VERSION; when a
deployment with the task registers, they are enqueued (keeping their place in the queue)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from run_engine.cron import Cron, CronError
from run_engine.db.deployments import QueueSpec, TaskSpec, queue_type
from run_engine.db.runs import Transition
from run_engine.db.tenancy import WorkerGroup
from run_engine.errors import NotFoundError, UnprocessableError, ValidationError
from run_engine.events import RunEvent
from run_engine.ids import new_id
from run_engine.statuses import ExecutionStatus, RunStatus
from systems import engine_jobs
from systems.resources import SystemResources

if TYPE_CHECKING:
    from systems.enqueue import EnqueueSystem
    from systems.execution_snapshot import ExecutionSnapshotSystem
    from systems.schedules import SchedulesSystem

log = logging.getLogger(__name__)
E = ExecutionStatus
BATCH = 200
#: the PENDING_VERSION runs a registration (a worker's connect) promotes itself; an engine job
#: promotes the rest, PROMOTE_PAGE a turn: a connect finding a million runs waiting answered after
#: minutes (past the supervisor's 10 s connect timeout: it connected again, and again)
CONNECT_PROMOTE = 2000
PROMOTE_PAGE = 2000


@dataclass(frozen=True, slots=True)
class Deployed:
    env_id: str
    deployment_id: str  # "" when refused
    version: str
    pending_runs_enqueued: int
    refused: str | None = None  # why this environment did not take it (its queue cap), if it did not


@dataclass(frozen=True, slots=True)
class Promoted:
    """A deployment a promote made current (``already_current``: it was, nothing changed)."""

    deployment_id: str
    version: str
    worker_group_id: str
    already_current: bool
    pending_runs_enqueued: int


class WaitingForWorkerSystem:
    def __init__(self, resources: SystemResources, *, execution_snapshot: ExecutionSnapshotSystem,
                 enqueue: EnqueueSystem, schedules: SchedulesSystem) -> None:
        self.r = resources
        self.execution_snapshot = execution_snapshot
        self.enqueue = enqueue
        self.schedules = schedules

    async def deploy(self, group: WorkerGroup, *, version: str | None, content_hash: str,
                     tasks: Sequence[TaskSpec], queues: Sequence[QueueSpec],
                     environments: Sequence[str] = ()) -> list[Deployed]:
        """A worker's deployment, registered in every environment the group serves (only the one
        an environment-scoped token names; only ``environments``, ids or slugs, when given).
        ``version`` defaults to the content hash's first 12 characters."""
        self.validate(tasks)
        envs = await self.r.repo.tenancy.environments_of_worker_group(group.id)
        if group.scoped_env_id:
            envs = [e for e in envs if e.id == group.scoped_env_id]
        if environments:
            wanted = set(environments)
            envs = [e for e in envs if e.id in wanted or e.slug in wanted]
        if not envs:
            raise UnprocessableError("no_environment",
                                     "this worker group serves no environment (run `run-engine bootstrap`)")
        # each environment on its own: one at its queue cap (custom queues its triggers made count)
        # keeps its current deployment and is answered as refused; the others take the new one.
        # Refused everywhere, the connect is refused
        out = []
        refusal: UnprocessableError | None = None
        for env in envs:
            try:
                dep_id, enqueued, registered = await self._register(
                    env_id=env.id, worker_group_id=group.id, version=version or content_hash[:12],
                    content_hash=content_hash, tasks=tasks, queues=queues)
            except UnprocessableError as exc:
                if exc.code != "too_many_queues":
                    raise
                log.warning("deployment %s not registered in environment %s: %s", version or content_hash[:12],
                            env.id, exc)
                refusal = refusal or exc
                out.append(Deployed(env.id, "", version or content_hash[:12], 0, refused=str(exc)))
                continue
            # the same content is the deployment registered before, with its version
            out.append(Deployed(env.id, dep_id, registered, enqueued))
        if refusal is not None and all(d.refused for d in out):
            raise refusal
        return out

    def validate(self, tasks: Sequence[TaskSpec]) -> None:
        ids = [t.id for t in tasks]
        if len(set(ids)) != len(ids):
            raise ValidationError("deployment.tasks", "task ids must be unique")
        now = datetime.fromtimestamp(self.r.clock.now(), UTC)
        for i, t in enumerate(tasks):
            if t.cron is not None:
                try:
                    # leniently, as the versions before (unchanged code declaring "/5 * * * *" still
                    # deploys, and its schedule fires as it did; SchedulesSystem warns of it)
                    Cron.parse(t.cron.pattern, lenient=True).next_after(now, t.cron.timezone)
                except CronError as exc:
                    raise ValidationError(f"deployment.tasks.{i}.cron", str(exc)) from None

    async def register_deployment(
        self, *, env_id: str, worker_group_id: str, version: str, content_hash: str,
        tasks: Sequence[TaskSpec], queues: Sequence[QueueSpec],
    ) -> tuple[str, int]:
        """Record the deployment (current from now on, unless it was registered before and a
        deployment registered after it is current: see the repository), mirror its queues'
        settings into the run queue and enqueue the runs that were waiting for it (when it is
        current). Returns (deployment id, runs enqueued).

        Refused (422 ``too_many_queues``, nothing written) when the queues it declares that the
        environment does not have would take it past ``max_queues_per_env``."""
        dep_id, enqueued, _ = await self._register(env_id=env_id, worker_group_id=worker_group_id, version=version,
                                                   content_hash=content_hash, tasks=tasks, queues=queues)
        return dep_id, enqueued

    async def _register(
        self, *, env_id: str, worker_group_id: str, version: str, content_hash: str,
        tasks: Sequence[TaskSpec], queues: Sequence[QueueSpec],
    ) -> tuple[str, int, str]:
        """:meth:`register_deployment`, and the version the deployment has (the one registered
        before with the same content, if any)."""
        self.validate(tasks)
        queue_list = self._queues(tasks, queues)
        dep_id, _, registered, current = await self.r.repo.deployments.register_deployment(
            deployment_id=new_id("deployment"), env_id=env_id, worker_group_id=worker_group_id,
            version=version, content_hash=content_hash, tasks=tasks, queues=queue_list,
            queue_ids=[new_id("queue") for _ in queue_list], max_queues=self.r.settings.max_queues_per_env,
        )
        if not current:
            # a worker of a version a later registration (or a promote) replaced, connecting again (a
            # rolling deploy): its deployment is answered and its workers run what it has, but the
            # crons and the runs waiting for a version (PENDING_VERSION) are the current deployment's
            log.info("deployment %s (version %s) connected again in environment %s: not current, a deployment "
                     "made current after it is", dep_id, registered, env_id)
        enqueued = await self._apply(env_id, worker_group_id, dep_id, tasks, queue_list, current=current)
        return dep_id, enqueued, registered

    async def _apply(self, env_id: str, worker_group_id: str, dep_id: str, tasks: Sequence[TaskSpec],
                     queue_list: Sequence[QueueSpec], *, current: bool) -> int:
        """What a deployment's registration (or promote) written in PostgreSQL does outside it: its
        queues mirrored into the run queue and, when it is current, its crons synced and the runs
        waiting for it enqueued (CONNECT_PROMOTE here, the rest by a promote_pending job). Each
        step may be done again: a process that died part way leaves the reconciler to mirror the
        queues and enqueue the runs, and the next connect or promote to sync the crons."""
        # its own queues only (read back: an override or pause of one is kept), and the caches of
        # its environment only: the environment's other queues and other tenants are not its cost
        await self.enqueue.mirror_queues(env_id, [q.name for q in queue_list])
        self.enqueue.invalidate(env_id)
        if not current:
            return 0
        await self.schedules.sync_declarative(env_id, worker_group_id, tasks)
        await self._crons_of_the_current(env_id, worker_group_id, dep_id)
        queue_of = {t.id: t.queue_name for t in tasks}
        waiting = await self.r.repo.runs.pending_version_runs(env_id, worker_group_id, list(queue_of),
                                                              limit=CONNECT_PROMOTE + 1)
        enqueued = await self.promote(waiting[:CONNECT_PROMOTE], dep_id, queue_of)
        if len(waiting) > CONNECT_PROMOTE:  # the rest by a job, a page a turn (its environment's lane)
            log.info("deployment %s: more than %d runs were waiting for it; the rest are enqueued in the "
                     "background", dep_id, CONNECT_PROMOTE)
            await self.r.change_jobs(schedule=[engine_jobs.promote_pending(dep_id, env_id, worker_group_id,
                                                                           self.r.clock.now())])
        return enqueued

    async def _crons_of_the_current(self, env_id: str, worker_group_id: str, dep_id: str) -> None:
        """After a deployment's crons were synced: when it is no longer current (a connect or
        promote of another one committed meanwhile, under the environment's lock, and may have
        synced its own crons before these), the current one's crons are synced again, so that the
        schedules are the current deployment's whichever sync ended last."""
        now = await self.r.repo.deployments.current_version(env_id, worker_group_id)
        if now is None or now[0] == dep_id:
            return
        decl = next((d for d in await self.r.repo.deployments.deployments_of_version(env_id, now[1], worker_group_id)
                     if d.id == now[0]), None)
        if decl is not None:
            log.info("deployment %s: replaced by %s while its crons were synced; the current one's synced again",
                     dep_id, now[0])
            await self.schedules.sync_declarative(env_id, worker_group_id, decl.tasks)

    async def promote_version(self, env_id: str, version: str, worker_group: str | None = None) -> list[Promoted]:
        """Make the environment's deployments of ``version`` current (one per worker group that has
        it, or that of the group named ``worker_group`` only, a name as the trigger option
        ``workerGroup`` gives it: 400 when the project has no such group): a rollback to an older
        version, or forward again.
        Each does what a connect that makes its deployment current does: its queues' declared
        settings written and mirrored, its crons synced, the PENDING_VERSION runs of its tasks
        enqueued. Promoting the current one changes nothing but does those again (so a promote
        that died part way is finished by sending it again). [] when no deployment of the
        environment has that version (in that group). 422 ``too_many_queues`` as a connect."""
        worker_group_id = None
        if worker_group is not None:
            env = await self.r.repo.tenancy.environment(env_id)
            if env is None:
                raise NotFoundError("environment", env_id)
            worker_group_id = await self.r.repo.tenancy.routable_worker_group(env.project_id,
                                                                              env.default_worker_group_id, worker_group)
            if worker_group_id is None:
                raise ValidationError("workerGroup", f"no worker group named {worker_group!r} in this project")
        decls = await self.r.repo.deployments.deployments_of_version(env_id, version, worker_group_id)
        if not decls:
            return []
        queue_lists = {d.id: self._queues(d.tasks, d.queues) for d in decls}
        made = await self.r.repo.deployments.make_current(
            env_id, [(d.id, queue_lists[d.id], [new_id("queue") for _ in queue_lists[d.id]]) for d in decls],
            max_queues=self.r.settings.max_queues_per_env)
        out = []
        for d in decls:
            if d.id not in made:  # gone meanwhile (its environment or group deleted)
                continue
            if made[d.id]:
                log.info("deployment %s (version %s) promoted: current in environment %s, worker group %s",
                         d.id, d.version, env_id, d.worker_group_id)
            enqueued = await self._apply(env_id, d.worker_group_id, d.id, d.tasks, queue_lists[d.id], current=True)
            out.append(Promoted(d.id, d.version, d.worker_group_id, already_current=not made[d.id],
                                pending_runs_enqueued=enqueued))
        return out

    async def promote_page(self, deployment_id: str, env_id: str, worker_group_id: str) -> bool:
        """Enqueue the next PROMOTE_PAGE PENDING_VERSION runs the deployment can run (its tasks, in
        the group and environment it registered for); whether more may be waiting. Nothing
        (False) once the deployment is no longer current (another was connected or promoted since:
        the runs still waiting are that one's to take, or wait for a deployment with their task)."""
        queue_of = await self.r.repo.deployments.task_queues(deployment_id, current=True)
        if not queue_of:  # deleted with its environment, or no longer current
            return False
        waiting = await self.r.repo.runs.pending_version_runs(env_id, worker_group_id, list(queue_of),
                                                              limit=PROMOTE_PAGE + 1)
        enqueued = await self.promote(waiting[:PROMOTE_PAGE], deployment_id, queue_of)
        log.info("deployment %s: %d more runs that waited for it enqueued%s", deployment_id, enqueued,
                 "; going on" if len(waiting) > PROMOTE_PAGE else "")
        return len(waiting) > PROMOTE_PAGE

    @staticmethod
    def _queues(tasks: Sequence[TaskSpec], queues: Sequence[QueueSpec]) -> list[QueueSpec]:
        """The queues a deployment has: those it declares, and each task's own unless it names one."""
        declared = {q.name: q for q in queues}
        for t in tasks:
            declared.setdefault(t.queue_name, QueueSpec(t.queue_name, type=queue_type(t.queue_name)))
        return list(declared.values())

    async def promote(self, run_ids: list[str], deployment_id: str, queue_of: dict[str, str]) -> int:
        """PENDING_VERSION runs → QUEUED on ``deployment_id`` (``queue_of``: task → its queue there),
        ``BATCH`` at a time (a lock call, a statement, a queue call each); a run no longer
        PENDING_VERSION is left alone. Returns how many were enqueued."""
        enqueued = 0
        for start in range(0, len(run_ids), BATCH):
            enqueued += await self._promote(run_ids[start:start + BATCH], deployment_id, queue_of)
        return enqueued

    async def _promote(self, run_ids: list[str], deployment_id: str, queue_of: dict[str, str]) -> int:
        async with self.r.locker.lock("pending_version", *run_ids):
            await self.r.repo.runs.assign_deployment(run_ids, deployment_id, queue_of)
            results = await self.execution_snapshot.append_many([
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
            self.r.events.emit(RunEvent("run_requeued", run.id, run.env_id, res.snapshot.id,
                                        {"reason": "deployment"}, attempt=run.attempt_number))
        return len(runs)
