"""``metadata``: a running task's metadata, as Trigger.dev's ``metadata`` (progress, status, counters).

Inside a task::

    from run_engine.sdk import metadata

    metadata.set("status", "downloading")
    metadata.increment("done")              # metadata.decrement("left", by=2)
    metadata.append("files", "a.csv")       # metadata.remove("files", "a.csv"), metadata.delete("status")
    metadata.parent.increment("children_done")   # the parent's metadata (metadata.root.*: the root's)
    metadata.current()                      # {"status": "downloading", "done": 1, "files": ["a.csv"]}
    await metadata.flush()                  # send now (else it is sent within a second or so)

A change is applied at once to the execution's own copy (``current()``, ``get()``), with the server's
semantics (:mod:`run_engine.metadata_ops`: ``$.`` keys are paths, ``append`` onto a missing key
makes a list, ...), and buffered; the buffered operations go to the server in one request
(``PUT /api/v1/runs/{runId}/metadata``, ``operations`` / ``parentOperations`` / ``rootOperations``,
with the run's token): about every second while the run executes (a timer armed by the first change,
never for a task that changes nothing), before the run blocks on a wait (it may be suspended then),
when the attempt completes, and when the task awaits ``flush()``. The server answers with the run's
metadata, which becomes the copy (with the changes made since re-applied): what other runs did to it
(``metadata.parent.*`` of its children) shows after a flush. ``metadata.parent.*`` and ``root.*`` are
not applied to the copy (a run without a parent is its own parent and root on the server).

Each request carries an ``Idempotency-Key`` of its own, which the server applies once (it remembers
a run's last few): a request whose answer was lost is kept whole, with its key, and sent again
before the changes made since (in a request of their own), so an increment the server applied
before the connection dropped is not counted twice.

Failures: a server away or overloaded (5xx, 408, 429, unreachable, an answer lost) keeps the request
for the next flush (a flush before a wait or at completion tries 3 times, 0.5 s and 1 s apart, first; a suspension
sends nothing more: changes other code of the task made while the wait was pending and that were
not sent yet are lost with the executor). A refusal
(another 4xx: 413 metadata too large, 400 an operation the server refuses) drops the operations of
that request and the copy is rebuilt from the server's last answer; an awaited ``flush()`` raises it
(:class:`~run_engine.sdk.errors.TaskError`), an automatic flush logs it and the next ``flush()``
raises it. Neither ever fails the run by itself. A value that is not JSON, a bad key or an increment
by a non-number raises at the call (TypeError / ValueError), before anything is buffered.

Replay: metadata calls are not journaled. An execution restored from a checkpoint (or a retry) runs
the task again from the start and replays its journal; until the replay has taken the journal's last
entry, metadata changes are skipped (not applied to the copy, not sent): the execution before made
them, and the copy starts from the run's metadata as the server has it, theirs included. So an
increment before a wait counts once. Changes after the journal's last entry are new and sent (a retry
after a failure makes again those its failed attempt made after its last journaled call, as any code
there runs again).

Outside a task every function raises RuntimeError (Trigger.dev's are no-ops in its worker without a
run, and throw outside a worker). Changes from a sync task (in its thread) are buffered as well;
``flush()`` is for async tasks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import orjson

from run_engine import metadata_ops
from run_engine.errors import ValidationError
from run_engine.sdk import runtime
from run_engine.sdk.client import request
from run_engine.sdk.errors import TaskError

log = logging.getLogger("run_engine.sdk.metadata")

#: buffered changes are sent this long after the first of them (and again while more come)
FLUSH_INTERVAL_S = 1.0
#: operations one request carries at most (the server's limit, the three lists together)
MAX_PER_REQUEST = metadata_ops.MAX_OPERATIONS
#: operations buffered at most (a server away for long): a change past it raises
MAX_BUFFERED = 100_000
#: a flush before a wait, at completion or awaited tries this often while the server is away
SETTLE_TRIES = 3
SETTLE_BACKOFF_S = 0.5
REQUEST_TIMEOUT_S = 10.0

OWN, PARENT, ROOT = "operations", "parentOperations", "rootOperations"
_NO_VALUE = object()

#: (run id, body, its idempotency key) → the server's answer
Sender = Callable[[str, dict[str, Any], str], Awaitable[Any]]


async def _put(run_id: str, body: dict[str, Any], key: str) -> Any:
    # tried once: the flush has its own tries, and keeps the operations when they fail; every try
    # of a request carries its key, so that the server applies it once however many reach it
    return await request("PUT", f"/api/v1/runs/{run_id}/metadata", json=body, timeout=REQUEST_TIMEOUT_S,
                         headers={"Idempotency-Key": key}, tries=1)


def _transient(exc: BaseException) -> bool:
    """A failure the server may get over (its operations are kept), not a refusal of them."""
    if isinstance(exc, TaskError):  # status 0: no answer; bad_response: not the server's (a proxy's page)
        return exc.status >= 500 or exc.status in (0, 408, 429) or exc.code == "bad_response"
    return isinstance(exc, httpx.TransportError | OSError | json.JSONDecodeError)


def _copy(value: Any) -> Any:
    return orjson.loads(orjson.dumps(value))


class RunMetadata:
    """One run's metadata in its executor: the execution's copy and the operations not sent yet.
    Changes may come from the loop's thread or a sync task's thread (``_lock``); sending is on the
    loop, one request at a time (``_flushing``)."""

    def __init__(self, run_id: str, seed: Any, loop: asyncio.AbstractEventLoop,
                 replaying: Callable[[], bool] = lambda: False, send: Sender | None = None) -> None:
        self.run_id = run_id
        self.loop = loop
        self._replaying = replaying
        self._send = send
        self._base: dict[str, Any] = seed if isinstance(seed, dict) else {}  # the server's, never changed
        self._local: dict[str, Any] = _copy(self._base)  # _base with the buffered own operations applied
        self._ops: dict[str, list[dict[str, Any]]] = {OWN: [], PARENT: [], ROOT: []}
        self._count = 0  # operations not sent yet, _unsent's included
        # a request that failed without an answer (the server may have applied it): sent again as it
        # was, with its key, before anything buffered since
        self._unsent: tuple[str, dict[str, list[dict[str, Any]]]] | None = None
        self._lock = threading.Lock()
        self._flushing = asyncio.Lock()
        self._armed = False  # a timer or an automatic flush is on its way
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._error: TaskError | None = None  # a refusal of an automatic flush, for the next flush()
        self._failing = False
        self._closed = False

    # --- the task's side -------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        return self._count

    def current(self) -> dict[str, Any]:
        with self._lock:
            result: dict[str, Any] = _copy(self._local)
        return result

    def get(self, key: str) -> Any:
        with self._lock:
            return _copy(self._local.get(key))

    def change(self, what: str, target: str, kind: str, key: str | None = None, value: Any = _NO_VALUE) -> None:
        """Buffer one operation (and apply it to the copy when it is the run's own)."""
        if self._replaying():
            return  # the execution before made it (see the module's doc)
        wire: dict[str, Any] = {"type": kind}
        if key is not None:
            wire["key"] = key
        local_value = None
        if value is not _NO_VALUE:
            if kind == "increment":
                wire["value"] = local_value = value  # a number, checked by parse_op
            else:
                try:
                    encoded = orjson.dumps(value)
                except TypeError as exc:
                    raise TypeError(f"{what}: {type(value).__name__} is not JSON: {exc}") from None
                # the copy holds what the server will (a date as its string, a tuple as a list),
                # and none of it shared with the operation sent
                wire["value"] = orjson.loads(encoded)
                local_value = orjson.loads(encoded) if target == OWN else wire["value"]
        try:
            op = metadata_ops.parse_op({**wire, "value": local_value} if "value" in wire else wire, what)
        except ValidationError as exc:
            raise ValueError(str(exc)) from None
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{what}: the run's attempt is over")
            if self._count >= MAX_BUFFERED:
                raise RuntimeError(f"{what}: {self._count} metadata operations are waiting to be sent "
                                   "(the server cannot be reached?)")
            ops = self._ops[target]
            if target == OWN:
                try:
                    self._local, _ = metadata_ops.apply(self._local, [op], metadata_ops.Budget())
                except ValidationError as exc:
                    raise ValueError(str(exc)) from None
                if kind == "update":  # replaces what the buffered ones would have done
                    self._count -= len(ops)
                    ops.clear()
            if not _merged(ops, wire):
                ops.append(wire)
                self._count += 1
            arm, self._armed = not self._armed, True
        if arm:
            self._arm_soon()

    async def flush(self) -> None:
        """Send what is buffered now; raise what refused it, or a refusal an automatic flush met."""
        error, self._error = self._error, None
        try:
            if self._count or self._flushing.locked():
                await self._flush(SETTLE_TRIES)
        finally:
            self._rearm()
        if error is not None:
            raise error

    # --- the runtime's side ----------------------------------------------------------------------

    async def settle(self, *, final: bool) -> None:
        """Send everything buffered (and wait for a flush under way): before the run blocks on a
        wait, or (``final``) before the attempt completes, after which nothing more is sent.
        Never raises: a failure is logged (and a refusal kept for the next ``flush()``)."""
        if final:
            self._cancel_timer()
        try:
            if self._count or self._flushing.locked():
                await self._flush(SETTLE_TRIES)
        except Exception as exc:
            if _transient(exc):
                log.warning("run %s: %d metadata operations could not be sent%s: %s", self.run_id, self._count,
                            " and are lost (the attempt is over)" if final else "", exc)
            else:
                log.warning("run %s: metadata operations refused: %s", self.run_id, exc)
                if not final and isinstance(exc, TaskError):
                    self._error = exc
        finally:
            if final:
                self.close()
            else:
                self._rearm()

    def close(self) -> None:
        """The execution is over (completed, suspended or abandoned): nothing more is sent."""
        with self._lock:
            self._closed = True
        self._cancel_timer()
        if self._task is not None:
            self._task.cancel()

    # --- sending ---------------------------------------------------------------------------------

    def _arm_soon(self) -> None:
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._arm()
        else:  # a sync task's thread
            self.loop.call_soon_threadsafe(self._arm)

    def _rearm(self) -> None:
        """Operations kept after a failure go with the next automatic flush."""
        with self._lock:
            arm = self._count > 0 and not self._armed and not self._closed
            self._armed |= arm
        if arm:
            self._arm()

    def _arm(self) -> None:
        if not self._closed:
            self._timer = self.loop.call_later(FLUSH_INTERVAL_S, self._tick)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        self._timer = None
        if not self._closed:
            self._task = self.loop.create_task(self._auto())

    async def _auto(self) -> None:
        """The automatic flush: one try; a failure is logged (once in a row), a refusal kept."""
        try:
            await self._flush(1)
            self._failing = False
        except Exception as exc:
            if not _transient(exc):
                log.warning("run %s: metadata operations refused: %s", self.run_id, exc)
                self._error = exc if isinstance(exc, TaskError) else self._error
            elif not self._failing:
                self._failing = True
                log.warning("run %s: metadata could not be sent (tried again in %ss): %s", self.run_id,
                            FLUSH_INTERVAL_S, exc)
        finally:
            self._task = None
            with self._lock:
                again = self._armed = self._count > 0 and not self._closed
            if again:
                self._arm()

    async def _flush(self, tries: int) -> None:
        """Send the buffered operations, MAX_PER_REQUEST a request. A transient failure is tried
        ``tries`` times, then raised with the operations kept; a refusal drops that request's
        operations and is raised."""
        send = self._send or _put
        async with self._flushing:
            while True:
                with self._lock:
                    taken = self._take()
                if taken is None:
                    return
                key, body = taken
                for attempt in range(tries):
                    try:
                        answer = await send(self.run_id, body, key)
                        break
                    except Exception as exc:
                        if _transient(exc) and attempt + 1 < tries:
                            await asyncio.sleep(SETTLE_BACKOFF_S * 2 ** attempt)
                            continue
                        with self._lock:
                            if _transient(exc):
                                self._put_back(key, body)
                            else:
                                self._rebase(None)  # without the refused ones
                        raise
                with self._lock:
                    self._rebase(answer)

    def _take(self) -> tuple[str, dict[str, list[dict[str, Any]]]] | None:
        """The next request: the one not answered before (as it was), else the buffered operations
        (MAX_PER_REQUEST at most) under a new key."""
        if self._unsent is not None:
            unsent, self._unsent = self._unsent, None
            self._count -= sum(len(ops) for ops in unsent[1].values())
            return unsent
        if not self._count:
            return None
        body: dict[str, list[dict[str, Any]]] = {}
        room = MAX_PER_REQUEST
        for name, ops in self._ops.items():
            body[name] = ops[:room]
            del ops[:room]
            room -= len(body[name])
        self._count -= MAX_PER_REQUEST - room
        return uuid.uuid4().hex, body

    def _put_back(self, key: str, body: dict[str, list[dict[str, Any]]]) -> None:
        """A request not answered is kept whole, with its key: the server may have applied it, and
        a request with other operations (more buffered since, an increment folded into one of its)
        would not be known as its repeat."""
        self._unsent = (key, body)
        self._count += sum(len(ops) for ops in body.values())

    def _rebase(self, answer: Any) -> None:
        """The copy: the server's metadata (its answer, else the last one) with the own operations
        buffered since applied again (one the server's metadata refuses is left out of the copy)."""
        metadata = answer.get("metadata") if isinstance(answer, dict) else None
        if isinstance(metadata, dict):
            self._base = metadata
        local: dict[str, Any] = _copy(self._base)
        for i, wire in enumerate(_copy(self._ops[OWN])):
            try:
                local, _ = metadata_ops.apply(local, [metadata_ops.parse_op(wire, f"operations.{i}")],
                                              metadata_ops.Budget())
            except ValidationError:
                continue
        self._local = local


def _merged(ops: list[dict[str, Any]], op: dict[str, Any]) -> bool:
    """Fold an increment into the buffered one just before it, of the same key: a counter bumped in
    a loop is one operation. Integers only (their sum is the same however the server adds them)."""
    if op["type"] != "increment" or not ops:
        return False
    last = ops[-1]
    if last["type"] != "increment" or last["key"] != op["key"]:
        return False
    a, b = last["value"], op["value"]
    if type(a) is not int or type(b) is not int or abs(a + b) > 2**53:
        return False
    last["value"] = a + b
    return True


# --- the public functions --------------------------------------------------------------------------

def _state(what: str) -> RunMetadata:
    rt = runtime.require(f"metadata.{what}")
    state = rt.metadata
    if state is None:
        if rt.run_id is None:
            raise RuntimeError(f"metadata.{what}: the running task has no run id")
        state = rt.metadata = RunMetadata(rt.run_id, rt.seed_metadata, rt.channel.loop, rt.replaying)
    return state


def current() -> dict[str, Any]:
    """The run's metadata as this execution knows it (a copy): the trigger's (or, restored, the
    server's) with this execution's changes applied, and what the server said at the last flush."""
    return _state("current").current()


def get(key: str) -> Any:
    """The value of a top-level key of :func:`current` (None when missing)."""
    return _state("get").get(key)


def set(key: str, value: Any) -> None:  # noqa: A001 - Trigger.dev's name
    """Set ``key`` (a ``$.a.b`` key is a path) to ``value`` (JSON)."""
    _state("set").change("metadata.set", OWN, "set", key, value)


def delete(key: str) -> None:
    """Remove the top-level ``key`` (Trigger.dev's ``metadata.del``)."""
    _state("delete").change("metadata.delete", OWN, "delete", key)


def increment(key: str, by: float = 1) -> None:
    """Add ``by`` to the number at ``key`` (a missing key or one holding no number counts as 0)."""
    _state("increment").change("metadata.increment", OWN, "increment", key, by)


def decrement(key: str, by: float = 1) -> None:
    """Subtract ``by`` (its absolute value, as Trigger.dev) from the number at ``key``."""
    _state("decrement").change("metadata.decrement", OWN, "increment", key, _negative(by))


def append(key: str, value: Any) -> None:
    """Append ``value`` to the list at ``key`` (a missing key becomes ``[value]``)."""
    _state("append").change("metadata.append", OWN, "append", key, value)


def remove(key: str, value: Any) -> None:
    """Remove every item equal to ``value`` from the list at ``key``."""
    _state("remove").change("metadata.remove", OWN, "remove", key, value)


def replace(value: dict[str, Any]) -> None:
    """Replace the whole metadata by ``value`` (an object)."""
    if not isinstance(value, dict):
        raise TypeError(f"metadata.replace takes an object (a dict), not {type(value).__name__}")
    _state("replace").change("metadata.replace", OWN, "update", None, value)


async def flush() -> None:
    """Send the buffered changes now. Raises :class:`~run_engine.sdk.errors.TaskError` when the
    server refuses them (dropped) or cannot be reached after 3 tries (kept for the next flush), and
    a refusal an automatic flush met since the last call."""
    await _state("flush").flush()


def _negative(by: Any) -> Any:
    if isinstance(by, bool) or not isinstance(by, int | float):
        return by  # refused by parse_op, naming the value
    return -abs(by)


class _Other:
    """``metadata.parent`` / ``metadata.root``: operations on the parent's (root's) metadata, sent
    with the run's own; not applied to this execution's copy."""

    def __init__(self, name: str, target: str) -> None:
        self._name = name
        self._target = target

    def _change(self, what: str, kind: str, key: str | None, value: Any = _NO_VALUE) -> None:
        _state(f"{self._name}.{what}").change(f"metadata.{self._name}.{what}", self._target, kind, key, value)

    def set(self, key: str, value: Any) -> None:
        self._change("set", "set", key, value)

    def delete(self, key: str) -> None:
        self._change("delete", "delete", key)

    def increment(self, key: str, by: float = 1) -> None:
        self._change("increment", "increment", key, by)

    def decrement(self, key: str, by: float = 1) -> None:
        self._change("decrement", "increment", key, _negative(by))

    def append(self, key: str, value: Any) -> None:
        self._change("append", "append", key, value)

    def remove(self, key: str, value: Any) -> None:
        self._change("remove", "remove", key, value)

    def replace(self, value: dict[str, Any]) -> None:
        if not isinstance(value, dict):
            raise TypeError(f"metadata.{self._name}.replace takes an object (a dict), not {type(value).__name__}")
        self._change("replace", "update", None, value)


parent = _Other("parent", PARENT)
root = _Other("root", ROOT)
