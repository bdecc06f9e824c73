"""The engine's systems, built in dependency order: each is given the siblings it calls (no
system reaches another through a shared back-pointer)."""

from __future__ import annotations

from dataclasses import dataclass

from systems.bulk_actions import BulkActionsSystem
from systems.cancel import CancelSystem
from systems.dead_letter import DeadLetterSystem
from systems.debounce import DebounceSystem
from systems.delayed_runs import DelayedRunsSystem
from systems.dequeue import DequeueSystem
from systems.enqueue import EnqueueSystem
from systems.execution_snapshot import ExecutionSnapshotSystem
from systems.explain import ExplainSystem
from systems.reconciler import ReconcilerSystem
from systems.resources import SystemResources
from systems.run_attempt import RunAttemptSystem
from systems.run_metadata import RunMetadataSystem
from systems.schedules import SchedulesSystem
from systems.waiting_for_worker import WaitingForWorkerSystem
from systems.waitpoints import WaitpointsSystem


@dataclass(eq=False)
class Systems:
    execution_snapshot: ExecutionSnapshotSystem
    enqueue: EnqueueSystem
    dequeue: DequeueSystem
    run_attempt: RunAttemptSystem
    cancel: CancelSystem
    dead_letter: DeadLetterSystem
    waiting_for_worker: WaitingForWorkerSystem
    waitpoints: WaitpointsSystem
    delayed_runs: DelayedRunsSystem
    debounce: DebounceSystem
    reconciler: ReconcilerSystem
    schedules: SchedulesSystem
    explain: ExplainSystem
    bulk_actions: BulkActionsSystem
    run_metadata: RunMetadataSystem

    @classmethod
    def build(cls, resources: SystemResources) -> Systems:
        """Each system gets the siblings it calls, so they are built in dependency order."""
        r = resources
        execution_snapshot = ExecutionSnapshotSystem(r)
        enqueue = EnqueueSystem(r)
        waitpoints = WaitpointsSystem(r, execution_snapshot=execution_snapshot, enqueue=enqueue)
        dead_letter = DeadLetterSystem(r, execution_snapshot=execution_snapshot, enqueue=enqueue,
                                       waitpoints=waitpoints)
        run_attempt = RunAttemptSystem(r, execution_snapshot=execution_snapshot, enqueue=enqueue,
                                       waitpoints=waitpoints, dead_letter=dead_letter)
        delayed_runs = DelayedRunsSystem(r, execution_snapshot=execution_snapshot, enqueue=enqueue,
                                         run_attempt=run_attempt)
        schedules = SchedulesSystem(r, enqueue=enqueue)
        cancel = CancelSystem(r, execution_snapshot=execution_snapshot, run_attempt=run_attempt)
        waiting_for_worker = WaitingForWorkerSystem(r, execution_snapshot=execution_snapshot, enqueue=enqueue,
                                                    schedules=schedules)
        return cls(
            execution_snapshot=execution_snapshot,
            enqueue=enqueue,
            dequeue=DequeueSystem(r, execution_snapshot=execution_snapshot, enqueue=enqueue, run_attempt=run_attempt,
                                  waitpoints=waitpoints, dead_letter=dead_letter),
            run_attempt=run_attempt,
            cancel=cancel,
            dead_letter=dead_letter,
            waiting_for_worker=waiting_for_worker,
            waitpoints=waitpoints,
            delayed_runs=delayed_runs,
            debounce=DebounceSystem(r, enqueue=enqueue, delayed_runs=delayed_runs),
            reconciler=ReconcilerSystem(r, execution_snapshot=execution_snapshot, enqueue=enqueue,
                                        run_attempt=run_attempt, delayed_runs=delayed_runs,
                                        waiting_for_worker=waiting_for_worker, dead_letter=dead_letter),
            schedules=schedules,
            explain=ExplainSystem(r),
            bulk_actions=BulkActionsSystem(r, enqueue=enqueue, cancel=cancel),
            run_metadata=RunMetadataSystem(r),
        )
