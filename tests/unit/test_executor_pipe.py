"""Messages between the supervisor and an executor never tear or vanish, whatever their size,
both ways, on the supervisor's uvloop (issue 11: a 2 MB call was lost 5 times in 5)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor.executor import Executor, ExecutorFailure, ExecutorPool

MB = 1024 * 1024


def _run(task: str, payload: Any, journal: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "run", "runId": "run_pipe", "task": task, "payload": payload, "attempt": 1, "tags": [],
            "queue": "q", "runToken": "rt_x", "apiUrl": "http://127.0.0.1:1", "journal": journal or []}


async def _scenario() -> None:
    ex = Executor("tests.unit.big_tasks")
    try:
        await ex.ready()
        calls: list[dict[str, Any]] = []

        def on_call(msg: dict[str, Any]) -> None:  # the supervisor journals it, then answers
            calls.append(msg)
            ex.reply(msg["id"], {})

        for _ in range(3):
            out = await ex.run(_run("big-output", {"size": 6 * MB}), max_duration_s=120, memory_mb=None)
            assert out["ok"] and len(out["output"]) == 6 * MB
            out = await ex.run(_run("big-step", {"size": 5 * MB}), max_duration_s=120, memory_mb=None,
                               on_call=on_call)
            assert out == {"ok": True, "output": 5 * MB} and len(calls[-1]["result"]) == 5 * MB
            out = await ex.run(_run("many-items", {"count": 1000}), max_duration_s=120, memory_mb=None,
                               on_call=on_call)
            assert out == {"ok": True, "output": 1000} and len(calls[-1]["result"]) == 1000
            # a restore: the journal the executor receives holds 8 MB
            journal = [{"sequence": 0, "kind": "step", "key": "big", "resolved": True, "result": "r" * 8 * MB}]
            before = len(calls)
            out = await ex.run(_run("big-step", {"size": 1}, journal), max_duration_s=120, memory_mb=None,
                               on_call=on_call)
            assert out == {"ok": True, "output": 8 * MB} and len(calls) == before  # replayed, not re-run
    finally:
        ex.stop()


def test_multi_megabyte_messages_cross_the_pipe_both_ways_on_uvloop() -> None:
    import uvloop  # the supervisor runs on it (a dependency on Linux)

    uvloop.run(asyncio.wait_for(_scenario(), 120))


async def _where() -> list[dict[str, int]]:
    pool = ExecutorPool("tests.unit.big_tasks")
    executors = [await pool.acquire() for _ in range(3)]
    try:
        out = [await ex.run(_run("where", None), max_duration_s=60, memory_mb=None) for ex in executors]
    finally:
        for ex in executors:
            pool.release(ex)
        pool.close()
    return [o["output"] for o in out]


def test_executors_are_forked_with_the_task_module_already_imported() -> None:
    """A new executor costs a fork, not an interpreter start and the task module's imports: the
    module was imported once, in the fork server, before any executor existed."""
    import uvloop

    where = uvloop.run(asyncio.wait_for(_where(), 120))
    assert len({w["runs_in"] for w in where}) == 3
    (imported_in,) = {w["imported_in"] for w in where}
    assert imported_in not in {w["runs_in"] for w in where} and imported_in != os.getpid()


def test_the_fork_server_also_imports_the_main_module_each_executor_sets_up_again(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import importlib.util
    import sys
    import types

    from supervisor.executor import preload

    main = types.ModuleType("__main__")
    main.__spec__ = importlib.util.find_spec("run_engine.cli")  # python -m run_engine.cli supervisor ...
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert preload("my.tasks") == ["my.tasks", "run_engine.cli", "supervisor.forkserver_preload"]
    main.__spec__ = importlib.util.find_spec("pytest.__main__")  # a package's __main__ is never set up again
    assert preload("my.tasks") == ["my.tasks", "supervisor.forkserver_preload"]
    main.__spec__ = None  # a script: multiprocessing runs it by path
    assert preload("my.tasks") == ["my.tasks", "supervisor.forkserver_preload"]


async def _hostile(kind: str, marker: str) -> None:
    ex = Executor("tests.unit.big_tasks")
    try:
        await ex.ready()
        with pytest.raises(ExecutorFailure) as failed:
            await ex.run(_run("writes-to-its-pipe", {"kind": kind, "marker": marker}), max_duration_s=60,
                         memory_mb=None)
        assert failed.value.error["type"] == "TASK_PROCESS_EXITED"
        assert not ex.alive
    finally:
        ex.kill()


@pytest.mark.parametrize("kind", ["pickle", "garbage"])
def test_a_frame_the_task_writes_itself_is_never_unpickled_and_ends_the_executor(kind: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An executor runs a tenant's code: what comes over its pipe is read as JSON only. A pickle
    that would run code in the supervisor, or bytes that are no JSON, end that executor (its run
    fails and is retried by policy) and run nothing in the supervisor."""
    import uvloop

    marker = tmp_path / "ran-in-the-supervisor"
    uvloop.run(asyncio.wait_for(_hostile(kind, str(marker)), 60))
    assert not marker.exists()


async def _suspensions() -> None:
    ex = Executor("tests.unit.big_tasks")
    try:
        await ex.ready()
        for i in range(3):  # one executor, run after run: each suspension stops its own run only
            await _suspended_then_answered(ex, i)
    finally:
        ex.stop()


async def _suspended_then_answered(ex: Executor, i: int) -> None:
    waits: list[dict[str, Any]] = []

    def on_call(msg: dict[str, Any]) -> None:
        waits.append(msg)
        ex.suspend()  # checkpointed: the executor stops the task

    token = {"token": f"waitpoint_{i}"}
    out = await ex.run(_run("waits-on-a-token", token), max_duration_s=60, memory_mb=None, on_call=on_call)
    assert out == {"type": "suspended"} and waits[0]["op"] == "wait"
    # late messages for the run that ended: a suspend and the wait's answer
    ex.suspend()
    ex.reply(waits[0]["id"], {"result": "late"})
    out = await ex.run(_run("big-output", {"size": 3}), max_duration_s=60, memory_mb=None)
    assert out == {"ok": True, "output": "ooo"}
    answered: list[int] = []

    def answer(msg: dict[str, Any]) -> None:
        answered.append(msg["id"])
        ex.reply(msg["id"], {"result": {"ok": True, "output": i}})

    out = await ex.run(_run("waits-on-a-token", token), max_duration_s=60, memory_mb=None, on_call=answer)
    assert out["ok"] and out["output"]["output"] == i and len(answered) == 1


def test_an_executor_stops_a_suspended_run_and_runs_the_next_unaffected_by_late_messages() -> None:
    import uvloop

    uvloop.run(asyncio.wait_for(_suspensions(), 60))


async def _answers_together() -> None:
    ex = Executor("tests.unit.big_tasks")
    try:
        await ex.ready()
        asked: list[dict[str, Any]] = []

        def on_call(msg: dict[str, Any]) -> None:  # every answer written at once, once all are asked
            asked.append(msg)
            if len(asked) == 5:
                for m in asked:
                    ex.reply(m["id"], {})

        out = await ex.run(_run("steps-at-once", {"n": 5}), max_duration_s=60, memory_mb=None, on_call=on_call)
        assert out == {"ok": True, "output": [0, 1, 2, 3, 4]}
    finally:
        ex.stop()


def test_answers_that_reach_an_executor_together_are_each_delivered() -> None:
    """The executor reads one message each time its pipe is readable (the loop calls again while
    more is there): five answers written back to back all reach their calls."""
    import uvloop

    uvloop.run(asyncio.wait_for(_answers_together(), 60))


async def _dies_behind_an_open_pipe(pid_file: Path) -> float:
    ex = Executor("tests.unit.big_tasks")
    try:
        await ex.ready()
        assert ex.alive
        began = asyncio.get_running_loop().time()
        with pytest.raises(ExecutorFailure) as failed:
            await ex.run(_run("exits-leaving-a-child", {"child_s": 30, "pid_file": str(pid_file)}),
                         max_duration_s=60, memory_mb=None)
        assert failed.value.error["type"] == "TASK_PROCESS_EXITED" and "code 3" in failed.value.error["message"]
        assert not ex.alive
        return asyncio.get_running_loop().time() - began
    finally:
        ex.kill()


def test_an_executor_that_dies_while_a_child_keeps_its_pipe_open_is_seen_dead(tmp_path: Path) -> None:
    """Liveness is the process's, not the pipe's: the run fails at once (not after the child's 30 s
    or the run's max duration), and the executor is not handed another run."""
    import uvloop

    pid_file = tmp_path / "child.pid"
    try:
        assert uvloop.run(asyncio.wait_for(_dies_behind_an_open_pipe(pid_file), 20)) < 20
    finally:
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)  # the child the task left behind


async def _killed_while_idle() -> None:
    pool = ExecutorPool("tests.unit.big_tasks")
    try:
        await pool.warm(1)
        (ex,) = pool._idle
        os.kill(ex.process.pid, 9)
        deadline = asyncio.get_running_loop().time() + 10
        while ex.alive:  # told by the loop, without asking the process
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        fresh = await pool.acquire()
        assert fresh is not ex and fresh.alive and pool.restarts == 1
        out = await fresh.run(_run("big-output", {"size": 2}), max_duration_s=60, memory_mb=None)
        assert out == {"ok": True, "output": "oo"}
        pool.release(fresh)
    finally:
        pool.close()


def test_an_idle_executor_killed_from_outside_is_replaced() -> None:
    import uvloop

    uvloop.run(asyncio.wait_for(_killed_while_idle(), 30))


async def _shapes() -> None:
    ex = Executor("tests.unit.big_tasks")
    try:
        await ex.ready()
        msg = {**_run("shape-async-ctx", None), "attempt": 3, "tags": ["a"]}
        out = await ex.run(msg, max_duration_s=30, memory_mb=None)
        assert out == {"ok": True, "output": {"run": "run_pipe", "attempt": 3, "task": "shape-async-ctx",
                                              "queue": "q", "tags": ["a"]}}
        out = await ex.run(_run("shape-async", {"x": 1}), max_duration_s=30, memory_mb=None)
        assert out == {"ok": True, "output": {"x": 1}}
        out = await ex.run(_run("shape-sync-ctx", None), max_duration_s=30, memory_mb=None)
        assert out == {"ok": True, "output": {"run": "run_pipe", "main_thread": False}}  # sync: in a thread
    finally:
        ex.stop()


def test_a_task_gets_its_context_only_if_it_takes_one_and_a_sync_task_runs_in_a_thread() -> None:
    asyncio.run(_shapes())


def _dead(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _pid_in(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


async def _gone_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within ``seconds``."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not _dead(pid):
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def _until(ready: Callable[[], object], seconds: float = 10) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not ready():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.02)


async def _ignores_its_suspension() -> None:
    ex = Executor("tests.unit.big_tasks")
    try:
        await ex.ready()

        def on_call(msg: dict[str, Any]) -> None:
            ex.suspend()  # checkpointed: the task is told to stop, and swallows it

        began = asyncio.get_running_loop().time()
        out = await ex.run(_run("swallows-its-suspension", {"token": "waitpoint_x"}), max_duration_s=60,
                           memory_mb=None, on_call=on_call)
        assert out == {"type": "suspended"}
        assert asyncio.get_running_loop().time() - began < 10  # the grace, not the task's 30 s
        assert await _gone_within(ex.process.pid or 0, 5) and not ex.alive
    finally:
        ex.kill()


def test_a_task_that_goes_on_after_its_run_was_suspended_is_killed() -> None:
    """Its run, restored elsewhere once its waits complete, must not also run on here."""
    import uvloop

    uvloop.run(asyncio.wait_for(_ignores_its_suspension(), 30))


async def _floods_its_pipe() -> None:
    ex = Executor("tests.unit.big_tasks")
    try:
        await ex.ready()
        with pytest.raises(ExecutorFailure) as failed:
            await ex.run(_run("steps-forever", None), max_duration_s=0.5, memory_mb=None,
                         on_call=lambda msg: ex.reply(msg["id"], {}))
        assert failed.value.error["type"] == "MAX_DURATION_EXCEEDED"
    finally:
        ex.kill()


def test_the_watchdog_runs_while_a_task_sends_message_after_message() -> None:
    """A message at least every 0.1 s skipped every duration, memory and liveness check."""
    import uvloop

    uvloop.run(asyncio.wait_for(_floods_its_pipe(), 20))


async def _huge_frame() -> None:
    ex = Executor("tests.unit.big_tasks")
    try:
        await ex.ready()
        with pytest.raises(ExecutorFailure) as failed:
            await ex.run(_run("announces-a-huge-frame", None), max_duration_s=60, memory_mb=None)
        assert failed.value.error["type"] == "TASK_MESSAGE_TOO_LARGE" and not failed.value.retryable
        assert str(1 << 30) in failed.value.error["message"]
        assert await _gone_within(ex.process.pid or 0, 5)
    finally:
        ex.kill()


def test_a_frame_over_the_limit_ends_the_executor_before_it_is_buffered() -> None:
    import uvloop

    uvloop.run(asyncio.wait_for(_huge_frame(), 20))


async def _supervisor_gone(task: str, pid_file: Path) -> None:
    ex = Executor("tests.unit.big_tasks")
    try:
        await ex.ready()
        called = asyncio.Event()
        run = asyncio.ensure_future(ex.run(_run(task, {"pid_file": str(pid_file), "seconds": 30,
                                                       "token": "waitpoint_x"}),
                                           max_duration_s=60, memory_mb=None, on_call=lambda msg: called.set()))
        await _until(lambda: called.is_set() or _pid_in(pid_file))
        assert ex._transport is not None
        # the supervisor's end of the pipe closes, as when it dies: then nothing kills the executor
        ex.process.kill = lambda: None  # type: ignore[method-assign]
        ex._transport.abort()
        assert await _gone_within(ex.process.pid or 0, 5)  # not after the task's 30 s
        del ex.process.kill
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError, ExecutorFailure):
            await run
    finally:
        ex.kill()


@pytest.mark.parametrize("task", ["sync-sleeps", "swallows-its-suspension"])
def test_an_executor_stops_its_run_at_once_when_its_supervisor_is_gone(task: str, tmp_path: Path) -> None:
    """Even a sync task in its thread, or one that swallows its cancellation: the run is run again
    elsewhere once its heartbeats stop, and must not also run on here."""
    import uvloop

    uvloop.run(asyncio.wait_for(_supervisor_gone(task, tmp_path / "pid"), 30))


async def _subprocess_killed(pid_file: Path) -> int:
    ex = Executor("tests.unit.big_tasks")
    try:
        await ex.ready()
        run = asyncio.ensure_future(ex.run(_run("starts-a-subprocess", {"pid_file": str(pid_file)}),
                                           max_duration_s=60, memory_mb=None))
        await _until(lambda: _pid_in(pid_file))
        child = _pid_in(pid_file) or 0
        ex.kill()  # a cancel, a max duration, a memory limit
        with contextlib.suppress(ExecutorFailure):
            await run
        assert await _gone_within(child, 5)
        return child
    finally:
        ex.kill()


def test_killing_an_executor_kills_what_its_task_started(tmp_path: Path) -> None:
    import uvloop

    pid_file = tmp_path / "pid"
    try:
        uvloop.run(asyncio.wait_for(_subprocess_killed(pid_file), 30))
    finally:
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


async def _many_calls_at_once() -> None:
    from supervisor.executor import MAX_OPEN_CALLS

    ex = Executor("tests.unit.big_tasks")
    try:
        await ex.ready()
        loop = asyncio.get_running_loop()
        open_calls: set[int] = set()
        most = 0

        def answer(call_id: int) -> None:
            open_calls.discard(call_id)
            ex.reply(call_id, {})

        def on_call(msg: dict[str, Any]) -> None:  # the supervisor answers each a little later
            nonlocal most
            open_calls.add(msg["id"])
            most = max(most, len(open_calls))
            loop.call_later(0.005, answer, msg["id"])

        out = await ex.run(_run("steps-at-once", {"n": 60}), max_duration_s=60, memory_mb=None, on_call=on_call)
        assert out == {"ok": True, "output": list(range(60))}
        assert most == MAX_OPEN_CALLS  # the others waited in the executor's pipe
        out = await ex.run(_run("big-output", {"size": 2}), max_duration_s=60, memory_mb=None)
        assert out == {"ok": True, "output": "oo"}  # the next run reads its pipe as ever
    finally:
        ex.stop()


def test_a_run_has_at_most_a_few_calls_open_at_once() -> None:
    """A task asking thousands of steps at once must not queue them all in the supervisor, ahead of
    every other run's requests to the engine: the rest wait in its own pipe."""
    import uvloop

    uvloop.run(asyncio.wait_for(_many_calls_at_once(), 30))


async def _steps_wait_on_a_wait() -> None:
    from supervisor.executor import MAX_OPEN_CALLS

    ex = Executor("tests.unit.big_tasks")
    try:
        await ex.ready()
        steps: list[int] = []

        def on_call(msg: dict[str, Any]) -> None:
            if msg["op"] == "journal":
                steps.append(msg["id"])  # not answered before the wait is
            else:
                assert len(steps) == MAX_OPEN_CALLS
                ex.reply(msg["id"], {"result": {"ok": True, "output": "approved"}})
                for call_id in steps:
                    ex.reply(call_id, {})

        out = await ex.run(_run("steps-and-a-wait", {"token": "waitpoint_x"}), max_duration_s=60, memory_mb=None,
                           on_call=on_call)
        assert out == {"ok": True, "output": [list(range(8)), "approved"]}
        out = await ex.run(_run("returns-past-its-steps", None), max_duration_s=60, memory_mb=None,
                           on_call=lambda msg: None)  # its steps are never answered
        assert out == {"ok": True, "output": "done"}
        stale: list[dict[str, Any]] = []
        out = await ex.run(_run("big-output", {"size": 2}), max_duration_s=60, memory_mb=None, on_call=stale.append)
        assert out == {"ok": True, "output": "oo"}
        assert stale == []  # the last run's held steps are not this run's to journal
    finally:
        ex.stop()


def test_held_steps_never_hold_a_wait_or_the_result_back() -> None:
    """Only steps wait while MAX_OPEN_CALLS are open: a wait passes them (it may be what answers
    them), and so does the run's result."""
    import uvloop

    uvloop.run(asyncio.wait_for(_steps_wait_on_a_wait(), 30))
