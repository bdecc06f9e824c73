"""Warm executor processes: each imports the task module once and then runs one run at a time,
as often as it is asked (no interpreter start per run).

The supervisor talks to an executor over a ``multiprocessing`` pipe: it sends
``{"type": "run", ...}`` and gets ``{"ok": True, "output": ...}`` or ``{"ok": False, "error": ...,
"retryable": bool}`` back. It watches the process: past the run's max duration, over its memory
limit, or dead, the executor is killed (if need be) and replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import orjson

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
        conn.send(result)


# --- the supervisor's side ----------------------------------------------------------------------

class Executor:
    def __init__(self, tasks_module: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=executor_main, args=(child, tasks_module), daemon=True)
        self.process.start()
        child.close()
        self.runs = 0

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
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send({"type": "stop"})
        except OSError:
            pass
        self.process.join(2)
        self.kill()

    async def run(self, msg: dict[str, Any], *, max_duration_s: float | None, memory_mb: int | None,
                  on_call: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Run one run; the task's calls (journal, waits) go to ``on_call``, which answers with
        :meth:`reply`. Returns the result, ``{"type": "suspended"}`` after :meth:`suspend`, or
        ``{"type": "abandoned"}``; raises :class:`ExecutorFailure` when the process had to die."""
        self.runs += 1
        self.conn.send(msg)
        return await self._receive(timeout_s=None, max_duration_s=max_duration_s, memory_mb=memory_mb,
                                   on_call=on_call)

    def reply(self, call_id: int, data: dict[str, Any]) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send({"type": "reply", "id": call_id, **data})

    def suspend(self) -> None:
        """Ask the running task to stop: its run was checkpointed."""
        with contextlib.suppress(OSError, ValueError):
            self.conn.send({"type": "suspend"})

    async def _receive(self, *, timeout_s: float | None, max_duration_s: float | None,
                       memory_mb: int | None, on_call: Callable[[dict[str, Any]], None] | None = None,
                       ) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        fd = self.conn.fileno()
        wake: asyncio.Future[None] = loop.create_future()

        def ready() -> None:
            if not wake.done():
                wake.set_result(None)

        loop.add_reader(fd, ready)
        started = time.monotonic()
        try:
            while True:
                # Woken by the pipe, or by a watchdog tick to check duration, memory and liveness.
                tick = loop.call_later(0.1, ready)
                await wake
                tick.cancel()
                wake = loop.create_future()
                try:
                    while not self.conn.closed and self.conn.poll():
                        result: dict[str, Any] = self.conn.recv()
                        if result.get("type") != "call":
                            return result
                        if on_call is not None:
                            on_call(result)
                except (EOFError, OSError):
                    pass  # the process is gone (or was killed): reported below
                elapsed = time.monotonic() - started
                if not self.process.is_alive() or self.conn.closed:
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
        finally:
            loop.remove_reader(fd)


class ExecutorPool:
    """Idle executors wait here for the next run; one per concurrent run at most."""

    def __init__(self, tasks_module: str) -> None:
        self.tasks_module = tasks_module
        self._idle: list[Executor] = []
        self.started = 0

    async def acquire(self) -> Executor:
        while self._idle:
            ex = self._idle.pop()
            if ex.process.is_alive():
                return ex
            ex.kill()
        ex = Executor(self.tasks_module)
        self.started += 1
        await ex.ready()
        return ex

    def release(self, ex: Executor) -> None:
        if ex.process.is_alive() and not ex.conn.closed:
            self._idle.append(ex)
        else:
            ex.kill()

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
