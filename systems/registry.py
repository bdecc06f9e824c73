"""The engine's systems registry: systems reach their siblings only through it."""

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
        systems = cls(
            snapshots=ExecutionSnapshotSystem(resources),
            enqueue=EnqueueSystem(resources),
            dequeue=DequeueSystem(resources),
            run_attempt=RunAttemptSystem(resources),
            cancel=CancelSystem(resources),
            dead_letter=DeadLetterSystem(resources),
            waiting_for_worker=WaitingForWorkerSystem(resources),
            waitpoints=WaitpointSystem(resources),
            delayed=DelayedRunSystem(resources),
            reconciler=Reconciler(resources),
            schedules=ScheduleSystem(resources),
            explain=ExplainSystem(resources),
        )
        resources.systems = systems
        return systems
