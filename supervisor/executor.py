"""Warm executor processes: each imports the task module once and then runs one run at a time,
as often as it is asked (no interpreter start per run). They are forked from a ``multiprocessing``
fork server that imported the task module first: a new executor costs a few milliseconds of CPU
instead of an interpreter start and every import (~0.1-0.3 s each when spawned), which matters
when the pool grows under load or replaces an executor that died.

The supervisor talks to an executor over a socket pair, one JSON document per frame (the 4-byte
length header of ``multiprocessing``'s ``send_bytes``): it sends ``{"type": "run", ...}`` and gets
``{"ok": True, "output": ...}`` or ``{"ok": False, "error": ..., "retryable": bool}`` back. JSON,
never pickle: an executor runs a tenant's code, and what it sends must not be able to run code in
the supervisor. The supervisor reads and writes its end on its event loop (no thread per executor).
It watches the process: past the run's max duration, over its memory limit, or dead, the executor
is killed (if need be) and replaced.
"""

from __future__ import annotations

import _signal  # signal.getsignal's own, without its enum conversion (see ProcessState)
import asyncio
import contextlib
import importlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, cast

import orjson

if TYPE_CHECKING:
    from run_engine.sdk.runtime import Channel

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

#: an error's message and stack trace are cut to this many characters in the executor (the engine
#: keeps 32 K of each): a task's exception of any size fails its run as any other does, instead of
#: ending its executor with a frame over MAX_FRAME_BYTES (TASK_MESSAGE_TOO_LARGE, not retried)
ERROR_TEXT_CHARS = 64 * 1024


def _text(value: str) -> str:
    """``value`` as it can be sent: lone surrogates (not UTF-8, refused by orjson) replaced, cut to
    ERROR_TEXT_CHARS."""
    if len(value) > ERROR_TEXT_CHARS:
        value = value[:ERROR_TEXT_CHARS] + f"\u2026 [cut: {len(value) - ERROR_TEXT_CHARS} more characters]"
    return value.encode("utf-8", "replace").decode("utf-8")


def _error_of(exc: BaseException) -> dict[str, Any]:
    """The attempt's error for ``exc``, whatever the task's exception does: its ``__str__`` may
    raise (traceback prints ``<exception str() failed>`` then; so do we), its text may not be
    UTF-8, or be of any size. Formatting it must never end the executor."""
    name = type(exc).__name__
    try:
        message = str(exc)
    except Exception:
        message = f"<{name}: str() failed>"
    try:
        stack = "".join(traceback.format_exception(exc))
    except Exception:
        stack = f"<the stack trace of {name} could not be formatted>"
    return {"type": "BUILT_IN_ERROR", "name": _text(name), "message": _text(message), "stackTrace": _text(stack)}


async def _run_one(msg: dict[str, Any], channel: Channel) -> dict[str, Any]:
    """Run ``msg``'s task; its calls go over ``channel``, the executor's for all its runs."""
    from run_engine.sdk import runtime
    from run_engine.sdk.context import AttemptInfo, Context, QueueInfo, RunInfo, TaskInfo
    from run_engine.sdk.errors import AbortTaskRunError
    from run_engine.sdk.tasks import REGISTRY

    task = REGISTRY.get(msg["task"])
    if task is None:
        return {"ok": False, "retryable": False,
                "error": {"type": "TASK_NOT_FOUND", "message": f"no task {msg['task']!r} in this worker"}}
    if os.environ.get("RUN_ENGINE_API_URL") != msg["apiUrl"]:
        os.environ["RUN_ENGINE_API_URL"] = msg["apiUrl"]
    os.environ["RUN_ENGINE_RUN_TOKEN"] = msg["runToken"]
    ctx = Context(run=RunInfo(msg["runId"], msg.get("tags") or []), attempt=AttemptInfo(msg["attempt"]),
                  task=TaskInfo(task.id), queue=QueueInfo(msg.get("queue", ""))) if task.wants_ctx else None
    # this task is what a suspension cancels; the task's code runs in it (and in its context)
    channel.begin(asyncio.current_task())
    rt = runtime.Runtime(channel, msg.get("journal") or [], msg.get("journalNext"), msg["runId"], msg.get("metadata"),
                         msg.get("attempt"))
    token = runtime.activate(rt)
    failed: dict[str, Any] | None = None
    try:
        try:
            output = await task.execute(msg["payload"], ctx)
        except AbortTaskRunError as exc:
            failed = {"ok": False, "retryable": False, "error": {**_error_of(exc), "type": "ABORT"}}
        except MemoryError as exc:
            failed = {"ok": False, "retryable": True, "error": {**_error_of(exc), "type": "TASK_PROCESS_OOM_KILLED"}}
        except Exception as exc:
            failed = {"ok": False, "retryable": True, "error": _error_of(exc)}
        if rt.metadata is not None:  # what the task changed, sent before its attempt completes
            await rt.metadata.settle(final=True)
    except asyncio.CancelledError:
        return {"type": "suspended" if channel.suspended else "abandoned"}
    except runtime.DuplicateExecution as exc:
        return {"type": "abandoned", "reason": str(exc)}
    finally:
        if rt.metadata is not None:
            rt.metadata.close()
        channel.end()
        runtime.activate(None)
        del token
    if failed is not None:
        return failed
    try:
        orjson.dumps(output)
    except TypeError as exc:
        return {"ok": False, "retryable": False, "error": {
            "type": "OUTPUT_NOT_JSON", "name": "TypeError",
            "message": f"task {task.id!r} returned {type(output).__name__}, which is not JSON: {exc}"}}
    return {"ok": True, "output": output}


def executor_main(conn: Connection, tasks_module: str) -> None:
    from run_engine.sdk import runtime

    # its own process group, which the supervisor kills with it: what its tasks start goes too
    os.setpgid(0, 0)
    importlib.import_module(tasks_module)
    loop = asyncio.new_event_loop()
    # one channel for every run: its reader is registered once (the loop reads it only while a run
    # runs; between runs the messages are read here). The supervisor gone (its end of the pipe
    # closed), a run's task, even a sync one in its thread, stops at once: another supervisor runs
    # the run again once its heartbeats are missed, and this execution must not go on beside it.
    channel = runtime.Channel(conn, loop, on_closed=_supervisor_gone)
    # the executor's thread pool (asyncio.to_thread, a sync task), kept across runs: a run whose
    # call in it is still going after the run (its thread busy) is as a thread left behind
    pool = _CountingPool(thread_name_prefix="run")
    loop.set_default_executor(pool)
    clean = ProcessState()
    conn.send_bytes(orjson.dumps({"type": "ready", "pid": os.getpid()}))
    while True:
        try:
            msg = orjson.loads(conn.recv_bytes())
        except (EOFError, KeyboardInterrupt):
            return
        if msg.get("type") == "stop":
            return
        if msg.get("type") != "run":
            continue  # a late reply or suspend for a run that already ended
        try:
            result = loop.run_until_complete(_run_one(msg, channel))
        finally:
            os.environ.pop("RUN_ENGINE_RUN_TOKEN", None)
            left = cancel_leftovers(loop)
            left += clean.threads_left(pool)
            clean.keep_env("RUN_ENGINE_API_URL")  # the executor's own, set for each run (when it changes)
            if not clean.restore():
                left += 1
        if left:
            result["retire"] = True
        conn.send_bytes(orjson.dumps(result))
        if left:
            # a task this run started ignored its cancellation, or a thread it started still runs:
            # it would go on during the next run on this executor (maybe another environment's),
            # call the supervisor in its name and read its run token; or what the run changed in
            # the process could not be put back. The executor is not reused (the supervisor
            # starts another).
            return


class _CountingPool(ThreadPoolExecutor):
    """A thread pool that knows how many of its calls have not ended."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.busy = 0
        self._count = threading.Lock()

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        with self._count:
            self.busy += 1
        future = super().submit(fn, *args, **kwargs)
        future.add_done_callback(self._done)
        return future

    def _done(self, _future: Any) -> None:
        with self._count:
            self.busy -= 1

    @property
    def own_threads(self) -> set[threading.Thread]:
        return set(self._threads)


class ProcessState:
    """What an executor's runs share through the process and must not hand from one run to the
    next (maybe another environment's): its working directory, environment variables, signal
    handlers, interval timer, and threads. Taken when the executor starts; :meth:`restore` puts
    it back after each run (only what changed: a few microseconds), :meth:`threads_left` counts
    the threads a run left running."""

    def __init__(self) -> None:
        self.cwd = os.getcwd()
        self.environ = dict(os.environ)
        # os.environ's own bytes (CPython's): compared in a microsecond, where the mapping decodes
        # every variable again; None elsewhere (then the mapping is compared)
        data = getattr(os.environ, "_data", None)
        self._data = dict(data) if isinstance(data, dict) else None
        # the named signals Python may handle (not the unnamed real-time ones: half the look-ups),
        # by number and as _signal keeps them (signal.getsignal makes an enum of each: 14 us a run
        # for the 31 of them, against 2)
        self.signals = {int(s): _signal.getsignal(int(s)) for s in signal.Signals
                        if s not in (signal.SIGKILL, signal.SIGSTOP)}
        self.threads = set(threading.enumerate())

    def keep_env(self, key: str) -> None:
        """Take the variable ``key`` as it is now into the snapshot (one the executor itself sets
        for its runs: put back, it would differ again at every run, and the environment be
        compared and set again variable by variable, ~20 us a run)."""
        value = os.environ.get(key)
        if value is None:
            self.environ.pop(key, None)
        else:
            self.environ[key] = value
        if self._data is not None:
            data = getattr(os.environ, "_data", {})
            encoded = os.environ.encodekey(key)
            if encoded in data:
                self._data[encoded] = data[encoded]
            else:
                self._data.pop(encoded, None)

    def restore(self) -> bool:
        """Put it back; False when some of it could not be (the executor is then not reused)."""
        ok = True
        signal.setitimer(signal.ITIMER_REAL, 0)  # an alarm the run set would fire in the next one
        try:
            if os.getcwd() != self.cwd:
                os.chdir(self.cwd)
        except OSError:  # its directory removed, or ours
            ok = False
        env, saved = os.environ, self.environ
        data = getattr(env, "_data", None)
        if (data != self._data) if self._data is not None else (env != saved):
            for key in [k for k in env if k not in saved]:
                del env[key]
            for key, value in saved.items():
                if env.get(key) != value:
                    env[key] = value
        for sig, handler in self.signals.items():
            if _signal.getsignal(sig) != handler:
                try:
                    signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
                except (OSError, TypeError, ValueError):
                    ok = False
        return ok

    def threads_left(self, pool: _CountingPool | None = None, grace_s: float = 1.0) -> int:
        """Threads started since the executor started still running ``grace_s`` after the run, the
        threads of ``pool`` (the executor's, idle between runs) apart, unless a call of the run is
        still going in it. A thread count alone says when there is nothing to look at (the usual
        case: no thread was started)."""
        deadline = time.monotonic() + grace_s
        while True:
            own = pool.own_threads if pool is not None else set()
            busy = pool.busy if pool is not None else 0
            if threading.active_count() == len(self.threads) + len(own) and not busy:
                return 0
            left = [t for t in threading.enumerate() if t not in self.threads and t not in own and t.is_alive()]
            remaining = deadline - time.monotonic()
            if (not left and not busy) or remaining <= 0:
                return len(left) + busy
            if left:
                left[0].join(min(remaining, 0.05))
            else:
                time.sleep(min(remaining, 0.01))


def _supervisor_gone() -> None:
    os._exit(75)


def cancel_leftovers(loop: asyncio.AbstractEventLoop, grace_s: float = 1.0) -> int:
    """Cancel the tasks a run left behind (background tasks its code started and never awaited):
    in a reused executor they would otherwise run on during the next run, possibly another
    environment's, and see its run token. Returns how many are still there after ``grace_s``
    (tasks that ignore their cancellation: the executor must not be reused)."""
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        loop.run_until_complete(asyncio.wait(pending, timeout=grace_s))
    return sum(1 for t in pending if not t.done())


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
_HEADER = struct.Struct("!i")  # multiprocessing's frame header; -1, then 8 bytes, for 2 GiB and over
_BIG = struct.Struct("!Q")
#: the largest message an executor may send (an output, a step's result, children to trigger): the
#: engine takes requests of 10 MiB at most, so anything larger could never be sent on, and a task
#: that announced gigabytes would have the supervisor, which serves every tenant's runs, buffer them
MAX_FRAME_BYTES = 64 * 1024 * 1024
#: how long a task told to stop (its run was suspended) may take to unwind before its executor is
#: killed: a task that swallows its cancellation would otherwise run on beside its restored self
SUSPEND_GRACE_S = 2.0
WATCH_S = 0.1  # the watchdog's period: duration, memory, liveness, a suspension not obeyed
#: journaled steps (and journal pages) of one run the supervisor handles at once; past it, the
#: executor's pipe is not read until one is answered, so that a task asking thousands at once waits
#: on its own pipe instead of queueing them all ahead of every other run's requests. Only these are
#: held (each is answered by one request, whatever else the run does): a wait may last until
#: another call of the run is answered (a child it triggers completes the tokens it waits on), and
#: the run's result must never wait behind a held step either.
MAX_OPEN_CALLS = 8
_HELD_OPS = frozenset({"journal", "journal_page"})
#: held steps that may wait here, read from the pipe, before it is read no further: the messages
#: behind them (a wait, the run's result) are read and go past them until then
MAX_QUEUED_HELD = 16


def frame(msg: dict[str, Any]) -> bytes:
    """``msg`` as the executor's ``Connection.recv_bytes`` reads it: a length header and JSON."""
    body = orjson.dumps(msg)
    if len(body) > 0x7FFFFFFF:
        return _HEADER.pack(-1) + _BIG.pack(len(body)) + body
    return _HEADER.pack(len(body)) + body


class _Frames(asyncio.Protocol):
    """The supervisor's end of an executor's socket, on the event loop: bytes are gathered until a
    frame is whole (a multi-megabyte message arrives in many reads), then decoded and handed on.
    Anything but a JSON object ends the pipe: the executor is then treated as dead."""

    def __init__(self, deliver: Callable[[Any], None]) -> None:
        self.deliver = deliver
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.too_large = 0  # the length of a frame refused for its size (the pipe then ends)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while len(buf) >= 4:
            (n,) = _HEADER.unpack_from(buf)
            start = 4
            if n == -1:
                if len(buf) < 12:
                    return
                (n,) = _BIG.unpack_from(buf, 4)
                start = 12
            end = start + n
            if n > MAX_FRAME_BYTES:  # refused before it is buffered
                self.too_large = n
                self._broken(f"a frame of {n} bytes (at most {MAX_FRAME_BYTES})")
                return
            if n < 0 or len(buf) < end:
                if n < 0:
                    self._broken(f"a frame header of length {n}")
                return
            with memoryview(buf) as view, view[start:end] as body:
                try:
                    msg = orjson.loads(body)
                except orjson.JSONDecodeError as exc:
                    msg = exc
            del buf[:end]
            if not isinstance(msg, dict):
                self._broken(f"a frame that is not a JSON object ({msg!r:.100})")
                return
            self.deliver(msg)

    def _broken(self, what: str) -> None:
        log.warning("executor pipe: %s; the executor is treated as dead", what)
        self.buf.clear()
        if self.transport is not None:
            self.transport.abort()  # connection_lost follows: _GONE

    def connection_lost(self, exc: Exception | None) -> None:
        self.deliver(_GONE)


class Executor:
    """One warm executor process, seen from the supervisor's event loop.

    Its end of the socket pair is read and written by the loop (a transport): reads are gathered
    into whole frames, so a multi-megabyte message is never torn, and a write never blocks the
    loop (the transport buffers what the executor has not read yet). Nothing is dropped silently:
    a message that cannot be sent is logged and the executor treated as dead."""

    def __init__(self, tasks_module: str) -> None:
        # the fork server is one per supervisor process, started with the first executor; it is
        # single-threaded (no lock held by another thread is copied into a child), and it starts
        # again by itself should it die
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(preload(tasks_module))
        conn, child = ctx.Pipe()
        self.process = ctx.Process(target=executor_main, args=(child, tasks_module), daemon=True)
        self.process.start()
        child.close()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(conn.fileno()))
        conn.close()
        self.runs = 0
        self.retired = False  # its last run left a task that ignored its cancellation: not reused
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._messages: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._broken: BaseException | None = None
        # the process's exit, told by the loop: its sentinel (written by the fork server when the
        # process ends) is watched once, so that `alive` asks no system call (multiprocessing's
        # is_alive() builds a selector and polls it each time: 4.5 us, twice per run)
        self._exited = False
        self._sentinel: int | None = None
        self._frames = _Frames(self._deliver)
        self._suspend_by: float | None = None  # told to stop its suspended run: killed if still at it then
        self._open_calls = 0  # steps of the run handed to the supervisor and not answered yet
        self._open_ids: set[Any] = set()  # their call ids
        self._queued_held = 0  # steps read from the pipe, not handed to the supervisor yet
        self._reading_paused = False

    def _deliver(self, msg: Any) -> None:
        self._messages.append(msg)
        if _held(msg):
            self._queued_held += 1
            if self._queued_held >= MAX_QUEUED_HELD:
                self._pause_reading(True)  # the rest waits in the pipe (its task's sends block)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _take_next(self) -> Any:
        """The next message that may be handed on (None: none): in order, but past the held ones (a
        step while MAX_OPEN_CALLS are open), which keep theirs."""
        messages = self._messages
        if not messages:
            return None
        if self._open_calls < MAX_OPEN_CALLS:
            msg = messages.popleft()
        else:
            for i, held in enumerate(messages):
                if not _held(held):
                    del messages[i]
                    return held
            return None
        if _held(msg):
            self._queued_held -= 1
            if self._queued_held < MAX_QUEUED_HELD:
                self._pause_reading(False)
        return msg

    async def _next(self, timeout_s: float) -> Any:
        """The next message, or None after ``timeout_s`` without one (a watchdog tick)."""
        msg = self._take_next()
        if msg is None:
            waiter = self._waiter = self._loop.create_future()
            tick = self._loop.call_later(timeout_s, _wake, waiter)
            try:
                await waiter
            finally:
                tick.cancel()
                self._waiter = None
            msg = self._take_next()
        return msg

    def _send(self, msg: dict[str, Any]) -> None:
        transport = self._transport
        try:
            if transport is None or transport.is_closing():
                raise ConnectionError("the pipe is closed")
            transport.write(frame(msg))
        except (OSError, TypeError, ValueError) as exc:  # TypeError: not JSON (a bug of ours)
            self._broken = exc
            log.warning("executor %s: a message of type %s could not be sent (%s); the executor is "
                        "treated as dead", self.process.pid, msg.get("type"), exc)

    async def ready(self, timeout_s: float = 60) -> None:
        self._sentinel = self.process.sentinel
        self._loop.add_reader(self._sentinel, self._on_exit)
        try:
            self._transport, _ = await self._loop.connect_accepted_socket(lambda: self._frames, self._sock)
            msg = await self._receive(timeout_s=timeout_s, max_duration_s=None, memory_mb=None)
        except BaseException:
            self._unwatch()  # an executor that never became ready leaves no reader on the loop
            raise
        if msg.get("type") != "ready":
            self._unwatch()
            raise RuntimeError(f"executor sent {msg!r} instead of ready")

    def rss_mb(self) -> float:
        # os.open and os.read: a third of open()'s cost (a file object and a text decoder), read
        # at every acquire and every watchdog tick
        try:
            fd = os.open(f"/proc/{self.process.pid}/statm", os.O_RDONLY)
            try:
                data = os.read(fd, 256)
            finally:
                os.close(fd)
            return int(data.split()[1]) * _PAGE / 2**20
        except (OSError, ValueError, IndexError):
            return 0.0

    def _on_exit(self) -> None:
        """The process ended (or the fork server did, which multiprocessing takes for the same):
        not alive from now on; the run it had, if any, fails at its next watchdog tick."""
        self._exited = True
        self._unwatch()

    def _unwatch(self) -> None:
        # before multiprocessing reads the sentinel (join) or closes it
        if self._sentinel is not None:
            self._loop.remove_reader(self._sentinel)
            self._sentinel = None

    def kill(self) -> None:
        """Kill the process and what its task started (its process group: a subprocess the task
        ran must not go on beside the run's next attempt)."""
        self._unwatch()
        pid = self.process.pid
        if pid is not None and (not self._exited or not _exists(pid)):
            # its group: while the executor lives (or, dead, while a process of its group does: the
            # pid is not given to another process while its group exists), never a pid reused by a
            # process started since (another executor, leading a group of the same number)
            with contextlib.suppress(ProcessLookupError, PermissionError):  # no group (yet): the process alone
                os.killpg(pid, signal.SIGKILL)
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        if self._transport is not None:
            self._transport.abort()
        else:
            self._sock.close()

    def stop(self) -> None:
        self._unwatch()
        self._send({"type": "stop"})
        self.process.join(2)
        self.kill()

    @property
    def alive(self) -> bool:
        return (self._broken is None and self._transport is not None and not self._transport.is_closing()
                and not self._exited)

    async def run(self, msg: dict[str, Any], *, max_duration_s: float | None, memory_mb: int | None,
                  on_call: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Run one run; the task's calls (journal, waits) go to ``on_call``, which answers with
        :meth:`reply`. Returns the result, ``{"type": "suspended"}`` after :meth:`suspend`, or
        ``{"type": "abandoned"}``; raises :class:`ExecutorFailure` when the process had to die."""
        self.runs += 1
        self._suspend_by = None
        self._open_calls = 0
        self._open_ids.clear()
        # steps of the previous run held back past its result: answered by nobody now, never handed
        # to this run's supervisor (they would be journaled in this run's name)
        self._messages = deque(m for m in self._messages if m is _GONE)
        self._queued_held = 0
        self._pause_reading(False)
        self._send(msg)
        return await self._receive(timeout_s=None, max_duration_s=max_duration_s, memory_mb=memory_mb,
                                   on_call=on_call)

    def reply(self, call_id: int, data: dict[str, Any]) -> None:
        self._send({"type": "reply", "id": call_id, **data})
        if call_id not in self._open_ids:  # not a counted call of this run (a wait, a late answer)
            return
        self._open_ids.discard(call_id)
        self._open_calls = len(self._open_ids)
        if self._open_calls < MAX_OPEN_CALLS:
            self._wake()  # a step held back may go now

    def _pause_reading(self, pause: bool) -> None:
        transport = self._transport
        if pause == self._reading_paused or transport is None or transport.is_closing():
            return
        self._reading_paused = pause
        if pause:
            transport.pause_reading()
        else:
            transport.resume_reading()

    def suspend(self) -> None:
        """Ask the running task to stop: its run was checkpointed. A task still running
        SUSPEND_GRACE_S later (it swallowed its cancellation) is killed with its executor: its run,
        restored elsewhere, must not also go on here."""
        self._suspend_by = time.monotonic() + SUSPEND_GRACE_S
        self._send({"type": "suspend"})

    async def _receive(self, *, timeout_s: float | None, max_duration_s: float | None,
                       memory_mb: int | None, on_call: Callable[[dict[str, Any]], None] | None = None,
                       ) -> dict[str, Any]:
        started = time.monotonic()
        checked = started
        while True:
            # a message, or a watchdog tick to check duration, memory and liveness: at least every
            # WATCH_S, also while the task sends message after message
            msg = await self._next(WATCH_S)
            if msg is not None and msg is not _GONE:
                if msg.get("type") != "call":
                    result = dict(msg)
                    if result.pop("retire", False):
                        self.retired = True  # see executor_main: the pool replaces it
                    return result
                if on_call is not None:
                    if _held(msg):  # at MAX_OPEN_CALLS, the next ones wait until one is answered
                        self._open_ids.add(msg.get("id"))
                        self._open_calls = len(self._open_ids)
                    on_call(msg)
                if time.monotonic() - checked < WATCH_S:
                    continue
            now = time.monotonic()
            checked, elapsed = now, now - started
            if self._suspend_by is not None and (now > self._suspend_by or msg is _GONE or not self.alive):
                # its run is suspended (restored elsewhere when its waits complete): nothing to report
                if now > self._suspend_by:
                    log.warning("executor %s: its task was told to stop %ss ago (its run is suspended) and "
                                "still runs: killed", self.process.pid, SUSPEND_GRACE_S)
                self.kill()
                return {"type": "suspended"}
            if msg is _GONE or not self.alive:
                self._unwatch()
                if self.process.is_alive():
                    self.process.kill()
                self.process.join(1)
                if self._frames.too_large:
                    raise ExecutorFailure({"type": "TASK_MESSAGE_TOO_LARGE", "message": (
                        f"the task sent a message of {self._frames.too_large} bytes (an output, a step's result "
                        f"or children to trigger); the most is {MAX_FRAME_BYTES}")}, retryable=False)
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


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _held(msg: Any) -> bool:
    """A call counted against MAX_OPEN_CALLS (a journaled step, a journal page)."""
    return isinstance(msg, dict) and msg.get("type") == "call" and msg.get("op") in _HELD_OPS


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


#: how long a run waits for an executor that is on its way back (told to stop a suspended run)
#: before a new one is started for it
RETURN_WAIT_S = 1.0


class ExecutorPool:
    """Idle executors wait here for the next run; one per concurrent run at most."""

    def __init__(self, tasks_module: str) -> None:
        self.tasks_module = tasks_module
        self._idle: list[Executor] = []
        self.started = 0
        self.busy = 0  # executors handed out and not released yet
        self.restarts = 0  # executors that died or were killed, so replaced
        # executors still busy whose run gave its slot back (suspended: they are stopping), and
        # since when; a run that finds no idle executor waits for one of them rather than start
        # another process, one run per executor, and not for one that is late (a task that
        # ignores its cancel: no run waits for it again)
        self._returning: dict[Executor, float] = {}
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def idle(self) -> int:
        return len(self._idle)

    def returning(self, ex: Executor) -> None:
        """``ex`` was told to stop its run and is about to be released."""
        self._returning[ex] = time.monotonic()

    def not_returning(self, ex: Executor) -> None:
        """``ex`` was counted as coming back (:meth:`returning`) but keeps its run: runs waiting
        for it look again (and start an executor if none other is on its way)."""
        if self._returning.pop(ex, None) is not None:
            self._wake_beyond()

    def _coming_back(self) -> int:
        """Executors told to stop less than RETURN_WAIT_S ago, not released yet."""
        since = time.monotonic() - RETURN_WAIT_S
        return sum(1 for told in self._returning.values() if told > since)

    async def acquire(self, memory_mb: int | None = None) -> Executor:
        """An idle executor, or a new one. An idle one whose RSS is at ``memory_mb`` (the run's
        limit) or over is not handed out but killed: memory an earlier run left in it (a cache, a
        run of a larger machine) would fail this run at its first watchdog tick
        (TASK_PROCESS_OOM_KILLED) for memory it never used."""
        while True:
            while self._idle:
                ex = self._idle.pop()
                if ex.alive and (memory_mb is None or ex.rss_mb() < memory_mb):
                    self.busy += 1
                    return ex
                ex.kill()
                self.restarts += 1
            if len(self._waiters) >= self._coming_back():
                break  # none on its way back for this run
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout(RETURN_WAIT_S):
                    await waiter
            except TimeoutError:
                break  # not back in time (a task that ignores its cancel): start another
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        ex = Executor(self.tasks_module)
        self.started += 1
        await ex.ready()
        self.busy += 1
        return ex

    def release(self, ex: Executor) -> None:
        self.busy -= 1
        self._returning.pop(ex, None)
        if ex.alive and not ex.retired:
            self._idle.append(ex)
        else:
            ex.kill()
            self.restarts += 1
        # the first run waiting takes it; runs waiting beyond the executors still coming back look
        # again too (and start one)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break
        self._wake_beyond()

    def _wake_beyond(self) -> None:
        """Wake the runs waiting beyond the executors still coming back (each starts one)."""
        while len(self._waiters) > self._coming_back():
            _wake(self._waiters.popleft())

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
