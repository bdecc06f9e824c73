"""Values the run queue takes and returns."""

from __future__ import annotations

from dataclasses import dataclass

from run_engine.records import record


@record
class EnqueueItem:
    """A run to put in the queue.

    ``score_ms`` orders runs inside their queue (queued-at minus priority: lower first);
    ``available_at_ms`` hides the run until then (delays, retry back-off).
    """

    run_id: str
    env_id: str
    queue: str
    worker_group: str
    score_ms: float
    available_at_ms: int | None = None
    concurrency_key: str | None = None
    task: str = ""
    reset_deliveries: bool = False


class Handed(list):  # type: ignore[type-arg]
    """What a dequeue returns: the runs handed out (a list), and ``retry_at_ms``, the earliest time
    a queue skipped for its rate limit may hand out a run again (None if none was). ``backlog``:
    environments this dequeue may serve (the group's, or those it was narrowed to) still had ready
    runs once it was done (a hint: another worker may take them first)."""

    retry_at_ms: int | None = None
    backlog: bool = False


@dataclass(frozen=True, slots=True)
class RateLimit:
    """GCRA: ``limit`` runs per ``period_ms``, up to ``burst`` of them at once."""

    limit: int
    period_ms: int
    burst: int = 1

    def gcra(self) -> tuple[int, int]:
        """Emission interval and burst tolerance in whole ms, rounded down as the version before
        this one reads them (the fields ``rate_t``, ``rate_tau``: 600 a second was 1 ms, 1,000 a
        second); the dequeue uses :meth:`gcra_us`."""
        interval = max(1, self.period_ms // self.limit)
        return interval, interval * (self.burst - 1)

    def gcra_us(self) -> tuple[int, int]:
        """Emission interval and burst tolerance in µs, the interval rounded up (never more runs than
        ``limit`` a period: 600 a second is 1,667 µs); a period under 1 ms counts as 1 ms."""
        interval = max(1, -(-max(1, self.period_ms) * 1000 // self.limit))
        return interval, interval * (self.burst - 1)

    def stored(self) -> str:
        """The run queue's form: "T,tau,T_us,tau_us" (:meth:`gcra`, then :meth:`gcra_us`)."""
        return ",".join(str(x) for x in (*self.gcra(), *self.gcra_us()))


@dataclass(frozen=True, slots=True)
class QueueSettings:
    """Everything the run queue holds of one queue's settings, to set at once
    (:meth:`RunQueue.configure_queues`): ``None`` unsets a limit. ``limit`` holds for each
    concurrency key of the queue (runs without one are a key of their own), as Trigger.dev's
    concurrencyLimit; ``key_limit`` too, when lower; ``cap``, over all its keys together (none by
    default; the engine sets none: ``task_queue`` has no such column). ``version`` (the settings'
    version in PostgreSQL) makes the run queue ignore these settings when it holds a newer copy
    (a copy of the same version too, but for a repair); None sets them whatever it holds."""

    env_id: str
    queue: str
    limit: int | None = None
    key_limit: int | None = None
    rate_limit: RateLimit | None = None
    paused: bool = False
    version: int | None = None
    cap: int | None = None


@record
class DequeuedMessage:
    """A run handed out by :meth:`RunQueue.dequeue`; it holds a slot at env, queue and key level
    until it is acked, nacked, released, removed, dead-lettered or enqueued again."""

    run_id: str
    env_id: str
    queue: str
    concurrency_key: str | None
    worker_group: str
    score_ms: float
    deliveries: int
    task: str
    #: when this delivery took it (the dequeue's now): with ``deliveries``, the delivery's own mark
    held_at_ms: int | None = None


DequeuedRun = DequeuedMessage
"""The name the design uses for :class:`DequeuedMessage` (the engine has its own ``DequeuedRun``)."""


@dataclass(frozen=True, slots=True)
class NackResult:
    """What a nack did: ``dead_lettered`` (past ``max_deliveries``) or due again at
    ``available_at_ms``; ``known`` is False when the queue had no such run."""

    dead_lettered: bool
    deliveries: int
    available_at_ms: int | None = None
    known: bool = True


@dataclass(frozen=True, slots=True)
class DlqEntry:
    run_id: str
    queue: str
    task: str
    reason: str
    dead_at_ms: int
    deliveries: int


@dataclass(frozen=True, slots=True)
class DeadMessage:
    """A DLQ entry to write again after Redis lost it: the run's message (``item``, as an enqueue
    writes it) in the DLQ since ``dead_at_ms``, with its reason and delivery count."""

    item: EnqueueItem
    dead_at_ms: int
    reason: str
    deliveries: int


@dataclass(frozen=True, slots=True)
class QueueStats:
    """``running``: the runs holding a slot of the queue, all its keys together; ``limit`` holds
    for each key (see :class:`QueueSettings`), ``cap`` for all together."""

    queued: int
    running: int
    limit: int | None
    key_limit: int | None
    paused: bool
    cap: int | None = None


@dataclass(frozen=True, slots=True)
class EnvStats:
    queued: int
    running: int
    limit: int
