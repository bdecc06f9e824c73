"""Warm executor processes: each imports the task module once and then runs one run at a time,
as often as it is asked (no interpreter start per run). They are forked from a ``multiprocessing``
fork server that imported the task module first: a new executor costs a few milliseconds of CPU
instead of an interpreter start and every import (~0.1-0.3 s each when spawned), which matters
when the pool grows under load or replaces an executor that died.

The supervisor talks to an executor over a ``multiprocessing`` pipe: it sends
``{"type": "run", ...}`` and gets ``{"ok": True, "output": ...}`` or ``{"ok": False, "error": ...,
"retryable": bool}`` back. It watches the process: past the run's max duration, over its memory
limit, or dead, the executor is killed (if need be) and replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import orjson

log = logging.getLogger("run_engine.supervisor")
_PAGE = os.sysconf("SC_PAGE_SIZE")


class ExecutorFailure(Exception):
    """The executor could not finish the run; ``error`` is the attempt's error, ``retryable`` says
    whether the engine may retry it."""

    def __init__(self, error: dict[str, Any], retryable: bool = True) -> None:
        super().__init__(error["message"])
        self.error = error
        self.retryable = retryable


# --- the child process ---------------------------------------------------------------------------

def _error_of(exc: BaseException) -> dict[str, Any]:
    return {"type": "BUILT_IN_ERROR", "name": type(exc).__name__, "message": str(exc),
            "stackTrace": "".join(traceback.format_exception(exc))}


async def _run_one(msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
    from run_engine.sdk import runtime
    from run_engine.sdk.context import AttemptInfo, Context, QueueInfo, RunInfo, TaskInfo
    from run_engine.sdk.errors import AbortTaskRunError
    from run_engine.sdk.tasks import REGISTRY

    task = REGISTRY.get(msg["task"])
    if task is None:
        return {"ok": False, "retryable": False,
                "error": {"type": "TASK_NOT_FOUND", "message": f"no task {msg['task']!r} in this worker"}}
    os.environ["RUN_ENGINE_API_URL"] = msg["apiUrl"]
    os.environ["RUN_ENGINE_RUN_TOKEN"] = msg["runToken"]
    ctx = Context(run=RunInfo(msg["runId"], msg.get("tags") or []), attempt=AttemptInfo(msg["attempt"]),
                  task=TaskInfo(task.id), queue=QueueInfo(msg.get("queue", "")))
    channel = runtime.Channel(conn, asyncio.get_running_loop())
    token = runtime.activate(runtime.Runtime(channel, msg.get("journal") or []))
    try:
        # a task of its own, so that a suspension can cancel it; it inherits the runtime context
        channel.task = asyncio.ensure_future(task.execute(msg["payload"], ctx))
        output = await channel.task
    except asyncio.CancelledError:
        return {"type": "suspended" if channel.suspended else "abandoned"}
    except runtime.DuplicateExecution as exc:
        return {"type": "abandoned", "reason": str(exc)}
    except AbortTaskRunError as exc:
        return {"ok": False, "retryable": False, "error": {**_error_of(exc), "type": "ABORT"}}
    except MemoryError as exc:
        return {"ok": False, "retryable": True, "error": {**_error_of(exc), "type": "TASK_PROCESS_OOM_KILLED"}}
    except Exception as exc:
        return {"ok": False, "retryable": True, "error": _error_of(exc)}
    finally:
        channel.close()
        runtime.activate(None)
        del token
    try:
        orjson.dumps(output)
    except TypeError as exc:
        return {"ok": False, "retryable": False, "error": {
            "type": "OUTPUT_NOT_JSON", "name": "TypeError",
            "message": f"task {task.id!r} returned {type(output).__name__}, which is not JSON: {exc}"}}
    return {"ok": True, "output": output}


def executor_main(conn: Connection, tasks_module: str) -> None:
    importlib.import_module(tasks_module)
    loop = asyncio.new_event_loop()
    conn.send({"type": "ready", "pid": os.getpid()})
    while True:
        try:
            msg = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if msg.get("type") == "stop":
            return
        if msg.get("type") != "run":
            continue  # a late reply or suspend for a run that already ended
        try:
            result = loop.run_until_complete(_run_one(msg, conn))
        finally:
            os.environ.pop("RUN_ENGINE_RUN_TOKEN", None)
            cancel_leftovers(loop)
        conn.send(result)


def cancel_leftovers(loop: asyncio.AbstractEventLoop, grace_s: float = 1.0) -> int:
    """Cancel the tasks a run left behind (background tasks its code started and never awaited):
    in a reused executor they would otherwise run on during the next run, possibly another
    environment's, and see its run token. Returns how many there were."""
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        loop.run_until_complete(asyncio.wait(pending, timeout=grace_s))
    return len(pending)


# --- the supervisor's side ----------------------------------------------------------------------

def preload(tasks_module: str) -> list[str]:
    """What the fork server imports before it forks any executor: the task module, the main module
    of this process (``python -m run_engine.cli``: each child sets it up again, as multiprocessing
    does, which is then cheap) and ``supervisor.forkserver_preload``."""
    main = getattr(sys.modules["__main__"].__spec__, "name", None)
    modules = [tasks_module]
    if main and main != "__main__" and not main.endswith(".__main__"):
        modules.append(main)
    return [*modules, "supervisor.forkserver_preload"]


_GONE = object()  # the reader's last word: the pipe is closed (the process exited or was killed)


class Executor:
    """One warm executor process, seen from the supervisor's event loop.

    The pipe is read and written by two threads with blocking I/O, never by the loop: a loop's
    reader callback (uvloop sets the fd non-blocking) could see a multi-megabyte message half
    there and tear it, and a blocking write would stall every other run. The reader hands each
    whole message to the loop; the writer sends in order. Nothing is dropped silently: a failed
    write is logged and the executor treated as dead."""

    def __init__(self, tasks_module: str) -> None:
        # the fork server is one per supervisor process, started with the first executor; it is
        # single-threaded (no lock held by another thread is copied into a child), and it starts
        # again by itself should it die
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(preload(tasks_module))
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=executor_main, args=(child, tasks_module), daemon=True)
        self.process.start()
        child.close()
        self.runs = 0
        self._loop = asyncio.get_running_loop()
        self._inbox: asyncio.Queue[Any] = asyncio.Queue()
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._broken: BaseException | None = None
        threading.Thread(target=self._read, name=f"executor-{self.process.pid}-read", daemon=True).start()
        threading.Thread(target=self._write, name=f"executor-{self.process.pid}-write", daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                msg = self.conn.recv()
                self._loop.call_soon_threadsafe(self._inbox.put_nowait, msg)
        except (EOFError, OSError, RuntimeError):  # RuntimeError: the loop closed at shutdown
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._inbox.put_nowait, _GONE)

    def _write(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self.conn.send(msg)
            except (OSError, ValueError) as exc:
                self._broken = exc
                log.warning("executor %s: a message of type %s could not be sent (%s); the executor is "
                            "treated as dead", self.process.pid, msg.get("type"), exc)
                return

    def _send(self, msg: dict[str, Any]) -> None:
        self._outbox.put(msg)

    async def ready(self, timeout_s: float = 60) -> None:
        msg = await self._receive(timeout_s=timeout_s, max_duration_s=None, memory_mb=None)
        if msg.get("type") != "ready":
            raise RuntimeError(f"executor sent {msg!r} instead of ready")

    def rss_mb(self) -> float:
        try:
            with open(f"/proc/{self.process.pid}/statm") as f:
                return int(f.read().split()[1]) * _PAGE / 2**20
        except (OSError, ValueError, IndexError):
            return 0.0

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self._outbox.put(None)
        self.conn.close()

    def stop(self) -> None:
        self._send({"type": "stop"})
        self.process.join(2)
        self.kill()

    @property
    def alive(self) -> bool:
        return self.process.is_alive() and not self.conn.closed and self._broken is None

    async def run(self, msg: dict[str, Any], *, max_duration_s: float | None, memory_mb: int | None,
                  on_call: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Run one run; the task's calls (journal, waits) go to ``on_call``, which answers with
        :meth:`reply`. Returns the result, ``{"type": "suspended"}`` after :meth:`suspend`, or
        ``{"type": "abandoned"}``; raises :class:`ExecutorFailure` when the process had to die."""
        self.runs += 1
        self._send(msg)
        return await self._receive(timeout_s=None, max_duration_s=max_duration_s, memory_mb=memory_mb,
                                   on_call=on_call)

    def reply(self, call_id: int, data: dict[str, Any]) -> None:
        self._send({"type": "reply", "id": call_id, **data})

    def suspend(self) -> None:
        """Ask the running task to stop: its run was checkpointed."""
        self._send({"type": "suspend"})

    async def _receive(self, *, timeout_s: float | None, max_duration_s: float | None,
                       memory_mb: int | None, on_call: Callable[[dict[str, Any]], None] | None = None,
                       ) -> dict[str, Any]:
        started = time.monotonic()
        while True:
            # a message, or a watchdog tick to check duration, memory and liveness
            try:
                msg = await asyncio.wait_for(self._inbox.get(), 0.1)
            except TimeoutError:
                msg = None
            if msg is not None and msg is not _GONE:
                if msg.get("type") != "call":
                    return dict(msg)
                if on_call is not None:
                    on_call(msg)
                continue
            elapsed = time.monotonic() - started
            if msg is _GONE or not self.alive:
                if self.process.is_alive():
                    self.process.kill()
                self.process.join(1)
                code = self.process.exitcode
                raise ExecutorFailure({"type": "TASK_PROCESS_EXITED",
                                       "message": f"the executor process exited with code {code}"})
            if max_duration_s is not None and elapsed > max_duration_s:
                self.kill()
                raise ExecutorFailure({"type": "MAX_DURATION_EXCEEDED",
                                       "message": f"the run exceeded its max duration of {max_duration_s:g}s"},
                                      retryable=False)
            if memory_mb is not None and self.rss_mb() > memory_mb:
                self.kill()
                raise ExecutorFailure({"type": "TASK_PROCESS_OOM_KILLED",
                                       "message": f"the run used more than its {memory_mb} MiB of memory"})
            if timeout_s is not None and elapsed > timeout_s:
                self.kill()
                raise RuntimeError("executor did not start in time")


class ExecutorPool:
    """Idle executors wait here for the next run; one per concurrent run at most."""

    def __init__(self, tasks_module: str) -> None:
        self.tasks_module = tasks_module
        self._idle: list[Executor] = []
        self.started = 0
        self.busy = 0  # executors handed out and not released yet
        self.restarts = 0  # executors that died or were killed, so replaced

    @property
    def idle(self) -> int:
        return len(self._idle)

    async def acquire(self) -> Executor:
        while self._idle:
            ex = self._idle.pop()
            if ex.alive:
                self.busy += 1
                return ex
            ex.kill()
            self.restarts += 1
        ex = Executor(self.tasks_module)
        self.started += 1
        await ex.ready()
        self.busy += 1
        return ex

    def release(self, ex: Executor) -> None:
        self.busy -= 1
        if ex.alive:
            self._idle.append(ex)
        else:
            ex.kill()
            self.restarts += 1

    async def warm(self, n: int) -> None:
        """Start ``n`` executors ahead of the first runs."""
        executors = [Executor(self.tasks_module) for _ in range(n)]
        self.started += n
        for ex in executors:
            await ex.ready()
        self._idle.extend(executors)

    def close(self) -> None:
        for ex in self._idle:
            ex.stop()
        self._idle.clear()
