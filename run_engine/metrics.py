"""Prometheus metrics of an API server process.

Counters and histograms are updated in process as the engine works (one engine event or timing is
one increment or observation, nothing more); with ``PROMETHEUS_MULTIPROC_DIR`` set they live in
that directory and a scrape of any process sums every process that shares it. The gauges that need
Redis or PostgreSQL are read at scrape time (:mod:`run_engine.gauges`), so the hot path never pays
for them and every process answers with the same numbers."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from run_engine.events import EVENT_NAMES, EventBus, RunEvent
from run_engine.timings import TIMINGS

if TYPE_CHECKING:
    from run_engine.engine import RunEngine

__all__ = ["CONTENT_TYPE_LATEST", "EngineMetrics", "render"]
log = logging.getLogger(__name__)

MULTIPROC_DIR = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")
if MULTIPROC_DIR:  # prometheus_client writes each process's values there from the first metric on
    os.makedirs(MULTIPROC_DIR, exist_ok=True)
disable_created_metrics()  # type: ignore[no-untyped-call]  # no `_created` series beside each counter

REGISTRY = CollectorRegistry()
if not MULTIPROC_DIR:
    ProcessCollector(registry=REGISTRY)

#: trigger → start: milliseconds when idle, minutes behind a backlog
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
#: one Redis/PostgreSQL round trip or a few
FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 15.0)

RUNS_CREATED = Counter("run_engine_runs_created", "Runs created, by their first status (QUEUED, DELAYED, "
                       "PENDING_VERSION).", ["status"], registry=REGISTRY)
RUNS_FINISHED = Counter("run_engine_runs_finished", "Runs that reached a final status, by that status.",
                        ["status"], registry=REGISTRY)
RUN_EVENTS = Counter("run_engine_run_events", "Engine events (state changes of runs), by event name.",
                     ["event"], registry=REGISTRY)
TRIGGER_TO_START = Histogram("run_engine_trigger_to_start_seconds", "From a run becoming QUEUED (trigger, delay "
                             "over, deployment arrived, redrive) to the start of its first attempt.",
                             buckets=WAIT_BUCKETS, registry=REGISTRY)
DEQUEUE = Histogram("run_engine_dequeue_seconds", "Duration of one engine dequeue call (queue script, run locks, "
                    "snapshot writes), by outcome: runs handed out or empty.", ["outcome"], buckets=FAST_BUCKETS,
                    registry=REGISTRY)
SCHEDULE_TICKS = Counter("run_engine_schedule_ticks", "Due schedule ticks this process dealt with, by outcome: "
                         "fired (a run made), skipped (the environment refused the run: its queue full, its task "
                         "not triggerable), stopped (the next tick cannot be worked out: the schedule deactivated).",
                         ["outcome"], registry=REGISTRY)
LEADER_DUTY_TIMEOUTS = Counter("run_engine_leader_duty_timeouts", "Runs of a leader duty (reconcile, rearm jobs, "
                               "retention) cancelled past their timeout, by duty.", ["duty"], registry=REGISTRY)
LOCK_WAIT = Histogram("run_engine_lock_wait_seconds", "From asking for a run lock to holding it, by the "
                      "operation that takes it.", ["lock"], buckets=FAST_BUCKETS, registry=REGISTRY)

FINAL_STATUSES = ("COMPLETED", "CANCELED", "FAILED", "CRASHED", "SYSTEM_FAILURE", "EXPIRED", "TIMED_OUT")
CREATED_STATUSES = ("QUEUED", "DELAYED", "PENDING_VERSION")
LEADER_DUTIES = ("reconcile", "rearm jobs", "retention")  # (engine.py's add_duty calls): series at 0 from the start


class EngineMetrics:
    """Feeds the counters and histograms from an engine's events and timings. Label children are
    bound once, so an event costs a dict look-up and an increment."""

    def __init__(self) -> None:
        self._events = {name: RUN_EVENTS.labels(name) for name in EVENT_NAMES}
        self._created = {s: RUNS_CREATED.labels(s) for s in CREATED_STATUSES}
        self._finished = {s: RUNS_FINISHED.labels(s) for s in FINAL_STATUSES}
        self._dequeue = {o: DEQUEUE.labels(o) for o in ("runs", "empty")}
        self._ticks = {o: SCHEDULE_TICKS.labels(o) for o in ("fired", "skipped", "stopped")}
        self._duty_timeouts = {d: LEADER_DUTY_TIMEOUTS.labels(d) for d in LEADER_DUTIES}
        self._locks: dict[str, Any] = {}

    def install(self, events: EventBus) -> Callable[[], None]:
        """Subscribe to ``events`` and the engine's timings; returns the function that undoes it."""
        unsubscribe = events.subscribe("*", self.on_event)
        TIMINGS.dequeue = self.on_dequeue
        TIMINGS.lock_wait = self.on_lock_wait
        TIMINGS.schedule_tick = self.on_schedule_tick
        TIMINGS.leader_duty_timeout = self.on_leader_duty_timeout

        def uninstall() -> None:
            unsubscribe()
            TIMINGS.reset()

        return uninstall

    def on_event(self, event: RunEvent) -> None:
        name = event.name
        counter = self._events.get(name)
        if counter is not None:
            counter.inc()
        if name == "run_created":
            self._status(self._created, RUNS_CREATED, event.data.get("status"))
        elif name == "attempt_started":
            queued_s = event.data.get("queued_s")
            if queued_s is not None:
                TRIGGER_TO_START.observe(queued_s)
        elif name == "run_succeeded":
            self._finished["COMPLETED"].inc()
        elif name in ("run_failed", "run_cancelled"):
            if event.data.get("final"):
                self._status(self._finished, RUNS_FINISHED, event.data.get("status"))
        elif name == "run_dead_lettered":
            self._finished["SYSTEM_FAILURE"].inc()

    @staticmethod
    def _status(children: dict[str, Any], metric: Counter, status: object) -> None:
        key = str(status) if status is not None else "UNKNOWN"
        child = children.get(key)
        if child is None and len(children) < 32:  # statuses are a fixed set; bound it anyway
            child = children[key] = metric.labels(key)
        if child is not None:
            child.inc()

    # The engine calls these in the middle of a dequeue or a lock acquisition: they never raise.

    def on_dequeue(self, outcome: str, seconds: float) -> None:
        try:
            self._dequeue[outcome].observe(seconds)
        except Exception:
            log.debug("dequeue timing not recorded", exc_info=True)

    def on_schedule_tick(self, outcome: str) -> None:
        try:
            self._ticks[outcome].inc()
        except Exception:
            log.debug("schedule tick not counted", exc_info=True)

    def on_leader_duty_timeout(self, duty: str) -> None:
        try:
            self._status(self._duty_timeouts, LEADER_DUTY_TIMEOUTS, duty)
        except Exception:
            log.debug("leader duty timeout not counted", exc_info=True)

    def on_lock_wait(self, lock: str, seconds: float) -> None:
        try:
            child = self._locks.get(lock)
            if child is None:  # lock names are literals in the systems: a few dozen at most
                child = self._locks[lock] = LOCK_WAIT.labels(lock)
            child.observe(seconds)
        except Exception:
            log.debug("lock wait not recorded", exc_info=True)


class _Families:
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def in_process_registry() -> CollectorRegistry:
    """This process's counters and histograms, or every process's with ``PROMETHEUS_MULTIPROC_DIR``."""
    if not MULTIPROC_DIR:
        return REGISTRY
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=MULTIPROC_DIR)  # type: ignore[no-untyped-call]
    return registry


async def render(engine: RunEngine) -> bytes:
    """The Prometheus text exposition of everything: in-process metrics, then scrape-time gauges."""
    from run_engine.gauges import collect

    gauges = await collect(engine)
    return generate_latest(in_process_registry()) + generate_latest(_Families(gauges))
