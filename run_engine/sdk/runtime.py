"""The executor's side of one running attempt: journal replay and calls to the supervisor.

Every journaled call of a task (``ctx.step``, ``wait.*``, ``tokens.create``, ``trigger_and_wait``)
takes the next sequence number. When the journal the attempt started with has an entry at that
number, the call returns the recorded result at once: this is how a run restored from a
checkpoint (or retried) continues where it stopped. Otherwise the call does its work and the
supervisor journals it through the worker API; a unique (run, sequence) makes a duplicate
execution lose that insert race and stop.

Fire-and-forget triggers (``Task.trigger``, ``Task.batch_trigger``) take no sequence number: each
one without a key of the author's carries :meth:`Runtime.call_key`, the same on every execution of
the attempt, so that a replay finds the run (or batch) its first execution made instead of making
another; a run suspended by a version that journaled nothing for them replays as it did.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import itertools
import os
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from run_engine.sdk.metadata import RunMetadata


class DuplicateExecution(BaseException):  # noqa: N818 - not an error the task should catch
    """Another execution of this run already journaled this call: stop without completing."""


class NonDeterminismError(Exception):
    """The task made a different journaled call than the journal recorded at this position."""


_call_ids = itertools.count(1)  # unique across the runs of one executor process


class Channel:
    """Requests from the task to the supervisor over the executor's pipe, replies matched by id;
    a ``suspend`` message cancels the running task."""

    def __init__(self, conn: Connection, loop: asyncio.AbstractEventLoop,
                 on_closed: Callable[[], None] | None = None) -> None:
        self.conn = conn
        self.loop = loop
        self.on_closed = on_closed  # the other end closed (the supervisor gone); else the task is cancelled
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.task: asyncio.Task[Any] | None = None
        self.suspended = False
        loop.add_reader(conn.fileno(), self._readable)
        # a loop may make the fd non-blocking (uvloop does): a multi-megabyte message must be read
        # and written whole, never torn by EAGAIN half-way
        os.set_blocking(conn.fileno(), True)

    def begin(self, task: asyncio.Task[Any] | None) -> None:
        """A new run on this channel (an executor keeps one for all its runs): ``task`` is what a
        ``suspend`` cancels."""
        self.task = task
        self.suspended = False

    def end(self) -> None:
        """The run is over: calls it left unanswered are cancelled; the channel stays open."""
        self.task = None
        waiting, self._waiting = self._waiting, {}
        for fut in waiting.values():
            fut.cancel()

    def close(self) -> None:
        self.loop.remove_reader(self.conn.fileno())
        self.end()

    def _readable(self) -> None:
        # One message per call: the loop calls again while the pipe has more (its polling is
        # level-triggered), and asking the pipe itself (``conn.poll()``) builds a selector each
        # time, a fifth of an executor's CPU per run.
        try:
            msg = orjson.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            if self.on_closed is not None:
                self.on_closed()
            self.loop.remove_reader(self.conn.fileno())  # read at EOF again and again otherwise
            if self.task is not None:
                self.task.cancel()
            return
        if msg.get("type") == "reply":
            fut = self._waiting.pop(msg["id"], None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif msg.get("type") == "suspend":
            self.suspended = True
            if self.task is not None:
                self.task.cancel()

    async def call(self, op: str, **data: Any) -> dict[str, Any]:
        call_id = next(_call_ids)
        # JSON, as every message to the supervisor: what cannot be sent fails this call, in the task
        frame = orjson.dumps({"type": "call", "id": call_id, "op": op, **data})
        fut: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        self._waiting[call_id] = fut
        self.conn.send_bytes(frame)
        reply = await fut
        if reply.get("duplicate"):
            raise DuplicateExecution(reply.get("message", "duplicate execution"))
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply


class Runtime:
    """A run's journaled calls in its executor: each takes the next sequence number and is replayed
    from the run's journal when the journal holds it. The journal comes a page at a time (a page
    holds at most 16 MiB of results): ``journal_next`` is the sequence of the first entry not
    received yet, and the next page is asked for when the replay gets there. An entry is let go
    once replayed: the executor holds a page of the journal at most, never all of it.

    ``metadata`` is the run's metadata as the attempt started (the trigger's, or the server's when
    restored); ``self.metadata``, made by the first ``metadata.*`` call of the task, buffers its
    changes (run_engine/sdk/metadata.py), sent before each wait and when the attempt completes."""

    def __init__(self, channel: Channel, journal: list[dict[str, Any]], journal_next: int | None = None,
                 run_id: str | None = None, metadata: Any = None, attempt: int | None = None) -> None:
        self.channel = channel
        self.attempt = attempt
        self._calls: dict[str, int] = {}  # the triggers made so far outside steps, by what they trigger
        self.journal = {e["sequence"]: e for e in journal}
        self._next = 0
        self._more = journal_next
        self._paging = asyncio.Lock()
        self.run_id = run_id
        self.seed_metadata = metadata
        self.metadata: RunMetadata | None = None

    def replaying(self) -> bool:
        """Whether the journal still holds entries the task has not replayed: what the task does
        until then, the execution before did too (metadata changes are not sent again)."""
        return bool(self.journal) or self._more is not None

    async def take(self, kind: str, key: str | None) -> tuple[int, dict[str, Any] | None]:
        seq = self._next  # taken before any wait: concurrent calls are numbered in the order they are made
        self._next += 1
        if self._more is not None and seq >= self._more:
            await self._page_up_to(seq)
        entry = self.journal.pop(seq, None)
        if entry is not None and (entry["kind"] != kind or (key is not None and entry["key"] != key)):
            raise NonDeterminismError(
                f"journal position {seq} holds {entry['kind']} {entry['key']!r} but the task now calls "
                f"{kind} {key!r}: task code must make the same journaled calls in the same order")
        return seq, entry

    def call_key(self, what: str) -> str | None:
        """The idempotency key of this attempt's next trigger of ``what`` (a task, or a batch of
        one): ``sdk:<run>:<attempt>:<what>:<n>``, ``n`` counting this execution's triggers of
        ``what`` from 0, so that every execution of the attempt (a restore replays the task from
        its start) gives its n-th trigger the same key as the first did. A trigger inside a step's
        function counts in that step (``sdk:<run>:<attempt>:s<sequence>:<what>:<n>``): a replay
        returns the step's result without calling it, and the triggers after the step keep their
        numbers. Another attempt (a retry) has keys of its own. None without a run (a test)."""
        if self.run_id is None or self.attempt is None:
            return None
        scope = _step_calls.get()
        where, calls = scope if scope is not None else ("", self._calls)
        n = calls.get(what, 0)  # taken before any wait: concurrent calls count in the order they are made
        calls[what] = n + 1
        return f"sdk:{self.run_id}:{self.attempt}:{where}{what}:{n}"

    async def _page_up_to(self, seq: int) -> None:
        """Receive the journal's pages until the one holding ``seq`` (or its end)."""
        async with self._paging:
            while self._more is not None and seq >= self._more:
                reply = await self.channel.call("journal_page", sequence=self._more)
                entries, following = reply.get("journal") or [], reply.get("next")
                if not entries and following == self._more:
                    raise RuntimeError(f"the run's journal could not be read from position {self._more}")
                for e in entries:
                    self.journal[e["sequence"]] = e
                self._more = following

    async def step(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        seq, entry = await self.take("step", name)
        if entry is not None:
            return entry["result"]
        scope = _step_calls.set((f"s{seq}:", {}))  # the triggers the function makes count in this step
        try:
            result = fn(*args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
        finally:
            _step_calls.reset(scope)
        try:
            encoded = orjson.dumps(result)
        except TypeError as exc:
            raise TypeError(f"step {name!r} returned {type(result).__name__}, which is not JSON: {exc}") from None
        # what the journal holds, which a replay returns: the same value now (a date as its string,
        # NaN as None, a tuple as a list), so that the run computes on with what it would restored
        result = orjson.loads(encoded)
        await self.channel.call("journal", sequence=seq, key=name, result=result)
        return result

    async def wait(self, kind: str, **request: Any) -> Any:
        """A journaled wait: replayed when resolved, re-blocked on its waitpoint when journaled but
        still pending, else asked of the supervisor (which may suspend the run meanwhile)."""
        seq, entry = await self.take(kind, None)
        if entry is not None:
            _same_wait(seq, entry, kind, request)
            if entry["resolved"]:
                return entry["result"]
            request = {"waitpointId": entry["waitpointId"]}
        if self.metadata is not None:  # the run may be suspended: its executor stops
            await self.metadata.settle(final=False)
        reply = await self.channel.call("wait", sequence=seq, kind=kind, **request)
        return reply["result"]


def _same_wait(seq: int, entry: dict[str, Any], kind: str, request: dict[str, Any]) -> None:
    """Raise NonDeterminismError when the journal's wait at ``seq`` is not the one the task makes
    now, as far as the entry tells: a token or run waited on (its id is the entry's key), the size
    of a batch. Its result would otherwise go to another wait than the one it answers."""
    waited = request.get("waitpointId")
    if waited is not None and waited not in (entry.get("key"), entry.get("waitpointId")):
        raise NonDeterminismError(
            f"journal position {seq} holds a wait on {entry.get('key')!r} but the task now waits on {waited!r}: "
            "task code must make the same journaled calls in the same order")
    results, items = entry.get("result"), request.get("items")
    if kind == "batch" and entry.get("resolved") and isinstance(results, list) and isinstance(items, list) \
            and len(results) != len(items):
        raise NonDeterminismError(
            f"journal position {seq} holds a batch of {len(results)} runs but the task now triggers {len(items)}: "
            "task code must make the same journaled calls in the same order")


_current: contextvars.ContextVar[Runtime | None] = contextvars.ContextVar("run_engine_runtime", default=None)
#: while a step's function runs: where its triggers count (``s<sequence>:``) and their counts
_step_calls: contextvars.ContextVar[tuple[str, dict[str, int]] | None] = contextvars.ContextVar(
    "run_engine_step_calls", default=None)


def current() -> Runtime | None:
    return _current.get()


def require(what: str) -> Runtime:
    rt = _current.get()
    if rt is None:
        raise RuntimeError(f"{what} can only be used inside a running task")
    return rt


def activate(rt: Runtime | None) -> contextvars.Token[Runtime | None]:
    return _current.set(rt)
