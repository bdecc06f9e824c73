"""The engine's systems, built in dependency order: each is given the siblings it calls (no
system reaches another through a shared back-pointer)."""

from __future__ import annotations

from dataclasses import dataclass

from systems.cancel import CancelSystem
from systems.dead_letter import DeadLetterSystem
from systems.delayed_runs import DelayedRunSystem
from systems.dequeue import DequeueSystem
from systems.enqueue import EnqueueSystem
from systems.execution_snapshot import ExecutionSnapshotSystem
from systems.explain import ExplainSystem
from systems.reconciler import Reconciler
from systems.resources import SystemResources
from systems.run_attempt import RunAttemptSystem
from systems.schedules import ScheduleSystem
from systems.waiting_for_worker import WaitingForWorkerSystem
from systems.waitpoints import WaitpointSystem


@dataclass(eq=False)
class Systems:
    snapshots: ExecutionSnapshotSystem
    enqueue: EnqueueSystem
    dequeue: DequeueSystem
    run_attempt: RunAttemptSystem
    cancel: CancelSystem
    dead_letter: DeadLetterSystem
    waiting_for_worker: WaitingForWorkerSystem
    waitpoints: WaitpointSystem
    delayed: DelayedRunSystem
    reconciler: Reconciler
    schedules: ScheduleSystem
    explain: ExplainSystem

    @classmethod
    def build(cls, resources: SystemResources) -> Systems:
        """Each system gets the siblings it calls, so they are built in dependency order."""
        r = resources
        snapshots = ExecutionSnapshotSystem(r)
        enqueue = EnqueueSystem(r)
        waitpoints = WaitpointSystem(r, snapshots=snapshots, enqueue=enqueue)
        dead_letter = DeadLetterSystem(r, snapshots=snapshots, enqueue=enqueue, waitpoints=waitpoints)
        run_attempt = RunAttemptSystem(r, snapshots=snapshots, enqueue=enqueue, waitpoints=waitpoints,
                                       dead_letter=dead_letter)
        delayed = DelayedRunSystem(r, snapshots=snapshots, enqueue=enqueue, run_attempt=run_attempt)
        schedules = ScheduleSystem(r, enqueue=enqueue)
        return cls(
            snapshots=snapshots,
            enqueue=enqueue,
            dequeue=DequeueSystem(r, enqueue=enqueue),
            run_attempt=run_attempt,
            cancel=CancelSystem(r, snapshots=snapshots, run_attempt=run_attempt),
            dead_letter=dead_letter,
            waiting_for_worker=WaitingForWorkerSystem(r, enqueue=enqueue, schedules=schedules),
            waitpoints=waitpoints,
            delayed=delayed,
            reconciler=Reconciler(r, snapshots=snapshots, enqueue=enqueue, run_attempt=run_attempt, delayed=delayed),
            schedules=schedules,
            explain=ExplainSystem(r),
        )
