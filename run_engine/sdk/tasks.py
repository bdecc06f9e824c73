"""Task authoring: ``@task``, ``queue(...)``, triggering from Python.

A module of tasks is what a supervisor runs (``--tasks my_app.tasks``): importing it fills the
registry, from which the supervisor builds the deployment it registers.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from run_engine.sdk import runtime
from run_engine.sdk.client import OWN_KEY_TTL, expect, sdk_key, send
from run_engine.sdk.errors import TaskError

MACHINES = {"micro": 256, "small-1x": 512, "small-2x": 1024, "medium-1x": 2048, "medium-2x": 4096,
            "large-1x": 8192, "large-2x": 16384}  # MiB of memory per preset

REGISTRY: dict[str, Task] = {}
QUEUES: dict[str, Queue] = {}


@dataclass(frozen=True, slots=True)
class Queue:
    name: str
    concurrency_limit: int | None = None
    rate_limit: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.concurrency_limit is not None:
            out["concurrencyLimit"] = self.concurrency_limit
        if self.rate_limit is not None:
            out["rateLimit"] = self.rate_limit
        return out


def queue(name: str, concurrency_limit: int | None = None, rate_limit: dict[str, Any] | None = None) -> Queue:
    """Declare a queue shared by tasks; ``concurrency_limit`` caps its runs at once, of each
    concurrency key (a trigger's ``concurrencyKey``; runs without one are a key of their own), as in
    Trigger.dev; ``rate_limit`` (``{"limit": 10, "period": "1s", "burst": 1}``) how many may start
    per period."""
    if not name or ":" in name:
        raise ValueError("queue names are non-empty and contain no ':'")
    if rate_limit is not None and not (isinstance(rate_limit.get("limit"), int) and rate_limit["limit"] >= 1):
        raise ValueError("rate_limit needs an integer 'limit' >= 1 (and optionally 'period', 'burst')")
    q = Queue(name, concurrency_limit, rate_limit)
    QUEUES[name] = q
    return q


@dataclass(frozen=True, slots=True)
class RunHandle:
    id: str
    is_cached: bool = False


class BatchItemsFailedError(Exception):
    """Some items of a batch made no run, though the others did: ``handles`` holds each item's
    run in item order (None for an item that failed), ``errors`` the failed items
    (``{index, taskIdentifier, error, errorCode}``)."""

    def __init__(self, handles: list[RunHandle | None], errors: list[dict[str, Any]]) -> None:
        what = "; ".join(f"item {e.get('index')}: {e.get('errorCode')}: {e.get('error')}" for e in errors[:5])
        super().__init__(f"{len(errors)} of {len(handles)} batch items made no run ({what})")
        self.handles = handles
        self.errors = errors


class TaskRunFailedError(Exception):
    def __init__(self, run_id: str, error: Any) -> None:
        message = error.get("message", "") if isinstance(error, dict) else str(error)
        super().__init__(f"run {run_id} failed: {message}")
        self.run_id = run_id
        self.error = error


@dataclass(frozen=True, slots=True)
class RunResult:
    """A finished child: ``ok`` with ``output``, or not ok with ``error``. A failed child does not
    raise in its parent; ``unwrap()`` does, when that is what the parent wants."""

    ok: bool
    id: str
    output: Any = None
    error: Any = None

    def unwrap(self) -> Any:
        if not self.ok:
            raise TaskRunFailedError(self.id, self.error)
        return self.output

    @classmethod
    def of(cls, data: dict[str, Any]) -> RunResult:
        return cls(data["ok"], data["id"], data.get("output"), data.get("error"))


@dataclass(eq=False)
class Task:
    id: str
    fn: Callable[..., Any]
    queue: Queue | None = None
    retry: dict[str, Any] | None = None
    max_duration: int | None = None
    machine: str | None = None
    cron: str | dict[str, str] | None = None
    wants_ctx: bool = field(init=False)
    is_async: bool = field(init=False)

    def __post_init__(self) -> None:
        params = inspect.signature(self.fn).parameters
        self.wants_ctx = len(params) >= 2
        self.is_async = inspect.iscoroutinefunction(self.fn)

    def declaration(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id}
        if self.queue is not None:
            out["queue"] = self.queue.name
        if self.retry:
            out["retry"] = self.retry
        if self.max_duration:
            out["maxDuration"] = self.max_duration
        if self.machine:
            out["machine"] = self.machine
        if self.cron:
            out["cron"] = self.cron
        return out

    async def execute(self, payload: Any, ctx: Any) -> Any:
        """Run the task function: async ones on the loop, sync ones in a thread."""
        args = (payload, ctx) if self.wants_ctx else (payload,)
        if self.is_async:
            return await self.fn(*args)
        return await asyncio.to_thread(self.fn, *args)

    async def trigger(self, payload: Any = None, options: dict[str, Any] | None = None) -> RunHandle:
        """Trigger a run of this task through the public API. Without ``options["idempotencyKey"]``
        the call carries one of its own, so that trying it again after a lost answer finds the run
        the first try made instead of making another: ``sdk:<uuid>``, or inside a task one that
        every execution of the attempt gives this call (:meth:`runtime.Runtime.call_key`), so that
        a run restored by replay gets back the run its first execution triggered (``is_cached``
        False, as then) instead of triggering a second one, for the key's TTL (30 days, or
        ``options["idempotencyKeyTTL"]``)."""
        options = dict(options or {})
        own = options.get("idempotencyKey") is None
        in_run = False
        if own:
            rt = runtime.current()
            key = rt.call_key(self.id) if rt is not None else None
            in_run = key is not None
            # its TTL the server's default (30 days) or the options' idempotencyKeyTTL: a longer one
            # keeps the child (retention keeps a run while its key holds) as long
            options["idempotencyKey"] = key if key is not None else sdk_key()
            if not in_run:  # kept for the call's tries only (see OWN_KEY_TTL)
                options.setdefault("idempotencyKeyTTL", OWN_KEY_TTL)
        answer = await send("POST", f"/api/v1/tasks/{self.id}/trigger",
                            json={"payload": payload, "options": options}, idempotent=True)
        data = expect(answer.data, "id", what=f"trigger {self.id}")
        # a run found by the call's own key is the run this call made (a debounced run it joined is not)
        cached = bool(data.get("isCached", False)) and not (own and (in_run or answer.resent)
                                                               and "debounce" not in options)
        return RunHandle(data["id"], cached)

    async def trigger_and_wait(self, payload: Any = None, options: dict[str, Any] | None = None) -> RunResult:
        """From inside a task: trigger a child run and wait for it (a RUN waitpoint); the parent
        may be suspended meanwhile and is restored by replay."""
        rt = runtime.require("trigger_and_wait")
        item = {"task": self.id, "payload": payload, "options": options or {}}
        return RunResult.of(await rt.wait("child", items=[item], batch=False))

    async def batch_trigger_and_wait(self, payloads: list[Any], options: dict[str, Any] | None = None,
                                     ) -> list[RunResult]:
        """From inside a task: one child per payload (up to 1,000, one request), wait for all (a
        BATCH waitpoint); results in item order."""
        if not payloads:
            return []
        rt = runtime.require("batch_trigger_and_wait")
        items = [{"task": self.id, "payload": p, "options": options or {}} for p in payloads]
        return [RunResult.of(r) for r in await rt.wait("batch", items=items, batch=True)]

    async def batch_trigger(self, items: list[Any], options: dict[str, Any] | None = None,
                            idempotency_key: str | None = None) -> list[RunHandle]:
        """Trigger one run per payload in one request (up to 1,000): a handle per payload, in
        order. Items that made no run while the others did (a debounced item failing after the
        others' runs were made) raise :class:`BatchItemsFailedError`, which holds the handles.
        The batch carries ``idempotency_key`` (the ``idempotency-key`` header), or one of its own,
        so that trying it again after a lost answer makes no run twice; inside a task, one that
        every execution of the attempt gives this call, so that a run restored by replay gets back
        the batch its first execution made (as :meth:`trigger`; for 30 days)."""
        rt = runtime.current() if idempotency_key is None else None
        key = rt.call_key(f"batch:{self.id}") if rt is not None else None
        in_run = key is not None
        headers = {"idempotency-key": idempotency_key if idempotency_key is not None else key or sdk_key()}
        if idempotency_key is None and key is None:  # kept for the call's tries only (see OWN_KEY_TTL)
            headers["idempotency-key-ttl"] = OWN_KEY_TTL
        answer = await send("POST", "/api/v1/tasks/batch", headers=headers, idempotent=True, json={
            "items": [{"task": self.id, "payload": p, "options": options or {}} for p in items]})
        data = expect(answer.data, "runs", what="batch trigger")
        errors = data.get("errors") or []
        if not isinstance(data["runs"], list) or not isinstance(errors, list) \
                or not all(isinstance(e, dict) and isinstance(e.get("index"), int) for e in errors) \
                or len(data["runs"]) + len(errors) != len(items):
            raise TaskError(200, "bad_response", f"batch trigger: {len(items)} items answered with "
                            f"{str(data)[:200]!r}")
        failed = {e["index"]: e for e in errors}
        # an item keyed by the batch (no key or debounce of its own) found by a retry is this call's own run
        own = idempotency_key is None and (in_run or answer.resent) \
            and not {"idempotencyKey", "debounce"} & set(options or {})
        made = iter(data["runs"])  # the other items' runs, in their order
        handles: list[RunHandle | None] = []
        for index in range(len(items)):
            run = None if index in failed else expect(next(made), "id", what="batch trigger")
            handles.append(None if run is None else RunHandle(run["id"], bool(run.get("isCached", False))
                                                              and not own))
        if failed:
            raise BatchItemsFailedError(handles, list(failed.values()))
        return [h for h in handles if h is not None]


def task(
    fn: Callable[..., Any] | None = None, *, id: str | None = None, queue: Queue | None = None,  # noqa: A002
    retry: dict[str, Any] | None = None, max_duration: int | None = None, machine: str | None = None,
    cron: str | dict[str, str] | None = None,
) -> Any:
    """Declare a task: ``@task`` or ``@task(id=..., queue=..., retry=..., max_duration=..., machine=...)``.

    ``cron`` (``"0 * * * *"`` or ``{"pattern": ..., "timezone": "Europe/Paris"}``) runs the task on
    that schedule in every environment the deployment serves (a declarative schedule).

    The function takes ``(payload)`` or ``(payload, ctx)``; it may be async or sync. Its return
    value must be JSON.
    """
    if machine is not None and machine not in MACHINES:
        raise ValueError(f"machine must be one of {sorted(MACHINES)}")

    def wrap(f: Callable[..., Any]) -> Task:
        t = Task(id=id or f.__name__.replace("_", "-"), fn=f, queue=queue, retry=retry,
                 max_duration=max_duration, machine=machine, cron=cron)
        if t.id in REGISTRY and REGISTRY[t.id].fn is not f:
            raise ValueError(f"two tasks have the id {t.id!r}")
        REGISTRY[t.id] = t
        return t

    return wrap(fn) if fn is not None else wrap


def deployment() -> dict[str, Any]:
    """The registry as the worker API's ``deployment`` body."""
    queues = {t.queue.name: t.queue for t in REGISTRY.values() if t.queue is not None} | QUEUES
    return {"tasks": [t.declaration() for t in REGISTRY.values()], "queues": [q.to_json() for q in queues.values()]}
