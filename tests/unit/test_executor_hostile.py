"""Hostile task code in a warm executor (from a review of the executor and the SDK runtime): what
a task raises, returns or leaves behind fails (or finishes) its own run cleanly, and neither kills
the executor nor reaches the next run."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from supervisor.executor import Executor, ExecutorPool

MB = 1024 * 1024


def _run(task: str, payload: Any = None, journal: list[dict[str, Any]] | None = None,
         token: str = "rt_x") -> dict[str, Any]:
    return {"type": "run", "runId": "run_hostile", "task": task, "payload": payload, "attempt": 1, "tags": [],
            "queue": "q", "runToken": token, "apiUrl": "http://127.0.0.1:1", "journal": journal or []}


def _in_loop(scenario: Any) -> Any:
    return asyncio.run(asyncio.wait_for(scenario, 90))


@pytest.mark.parametrize(("task", "payload", "says"), [
    ("raises-unprintable", None, "_Unprintable"),  # its __str__ raises
    ("raises-surrogate", None, "half a character"),  # a lone surrogate: not UTF-8, not JSON
    ("raises-huge", 70 * MB, "xxxx"),  # over the pipe's 64 MiB frame limit
])
def test_an_error_that_cannot_be_printed_or_sent_as_is_fails_its_run_and_keeps_the_executor(
        task: str, payload: Any, says: str) -> None:
    """Before: the executor died formatting or sending the error (TASK_PROCESS_EXITED, the error
    lost; or TASK_MESSAGE_TOO_LARGE, not retried, for a message the engine would have cut)."""

    async def scenario() -> None:
        ex = Executor("tests.unit.big_tasks")
        try:
            await ex.ready()
            out = await ex.run(_run(task, payload), max_duration_s=60, memory_mb=None)
            assert out["ok"] is False and out["retryable"] is True, out
            assert out["error"]["type"] == "BUILT_IN_ERROR" and says in out["error"]["message"]
            assert len(out["error"]["message"]) < MB and len(out["error"]["stackTrace"]) < MB
            assert ex.alive  # and reused
            assert await ex.run(_run("ok"), max_duration_s=60, memory_mb=None) == {"ok": True, "output": "ok"}
        finally:
            ex.kill()

    _in_loop(scenario())


def test_a_step_returns_what_its_replay_will_return() -> None:
    """A step's result is what the journal holds, on its first execution as on a replay. Before: the
    first execution got the Python value (a datetime, NaN, a tuple) and a replay its JSON (a string,
    None, a list), so a restored run saw another value than the one it computed with (and code
    such as ``value["at"].year`` failed only once the run was suspended)."""

    async def scenario() -> None:
        ex = Executor("tests.unit.big_tasks")
        try:
            await ex.ready()
            journaled: list[dict[str, Any]] = []

            def on_call(msg: dict[str, Any]) -> None:  # the supervisor journals the step
                journaled.append(msg)
                ex.reply(msg["id"], {})

            first = await ex.run(_run("step-of-python-values"), max_duration_s=60, memory_mb=None, on_call=on_call)
            assert first["ok"] and len(journaled) == 1
            entry = {"sequence": 0, "kind": "step", "key": "values", "resolved": True,
                     "result": journaled[0]["result"]}
            replay = await ex.run(_run("step-of-python-values", journal=[entry]), max_duration_s=60,
                                  memory_mb=None, on_call=on_call)
            assert replay["ok"] and len(journaled) == 1  # replayed, not run again
            assert first["output"] == replay["output"] == repr({"at": "2024-01-02T03:04:05", "nan": None,
                                                                "pair": [1, 2]})
        finally:
            ex.kill()

    _in_loop(scenario())


def test_an_executor_whose_run_left_a_thread_is_not_reused(tmp_path: Path) -> None:
    """A thread a run started and left running would go on during the next run of its executor
    (maybe another environment's) and read that run's token. Before: only asyncio tasks were
    looked for, and the executor was reused (the thread read rt_second)."""
    seen = tmp_path / "seen"

    async def scenario() -> None:
        pool = ExecutorPool("tests.unit.big_tasks")
        try:
            ex = await pool.acquire()
            out = await ex.run(_run("uses-a-thread"), max_duration_s=60, memory_mb=None)
            assert out == {"ok": True, "output": "joined"} and not ex.retired  # a thread that ended: reused
            out = await ex.run(_run("leaves-a-thread", str(seen), token="rt_first"), max_duration_s=60,
                               memory_mb=None)
            assert out == {"ok": True, "output": "left"}
            assert ex.retired
            pool.release(ex)
            nxt = await pool.acquire()
            assert nxt is not ex
            assert await nxt.run(_run("ok", token="rt_second"), max_duration_s=60, memory_mb=None) == \
                {"ok": True, "output": "ok"}
            pool.release(nxt)
        finally:
            pool.close()

    _in_loop(scenario())
    assert "rt_second" not in (seen.read_text() if seen.exists() else "")


def test_a_call_left_busy_in_the_executors_thread_pool_retires_it_and_an_idle_pool_thread_does_not() -> None:
    """The executor's thread pool is kept across runs (one a run cost every run a thread pool and
    ~40 us): its idle threads are no run's, but a call of the run still going in it after the run
    is a thread left behind."""

    async def scenario() -> None:
        pool = ExecutorPool("tests.unit.big_tasks")
        try:
            ex = await pool.acquire()
            first = await ex.run(_run("sync-task"), max_duration_s=60, memory_mb=None)
            second = await ex.run(_run("sync-task"), max_duration_s=60, memory_mb=None)
            assert first["ok"] and second["ok"] and not ex.retired  # its pool thread, idle: reused
            out = await ex.run(_run("leaves-a-pool-call"), max_duration_s=60, memory_mb=None)
            assert out == {"ok": True, "output": "left"} and ex.retired
            pool.release(ex)
        finally:
            pool.close()

    _in_loop(scenario())


def test_a_run_leaves_no_cwd_environment_signal_handler_or_alarm_to_the_next(tmp_path: Path) -> None:
    """Before: the next run on the executor (maybe another environment's) ran in the directory the
    previous one moved to, read the variables it set, had its SIGTERM handler, and got its alarm."""

    async def scenario() -> None:
        ex = Executor("tests.unit.big_tasks")
        try:
            await ex.ready()
            before = await ex.run(_run("process-state"), max_duration_s=60, memory_mb=None)
            assert before["ok"] and before["output"]["secret"] is None and before["output"]["sigterm"]
            out = await ex.run(_run("leaves-process-state", str(tmp_path)), max_duration_s=60, memory_mb=None)
            assert out == {"ok": True, "output": "left"}
            after = await ex.run(_run("process-state"), max_duration_s=60, memory_mb=None)
            assert after == before and not ex.retired
        finally:
            ex.kill()

    _in_loop(scenario())


def test_a_run_is_not_killed_for_the_memory_an_earlier_run_left_in_its_executor() -> None:
    """An executor whose earlier run (of a larger machine, or no limit) left its RSS over this run's
    memory limit is not handed to it. Before: the run was killed at its first watchdog tick as
    TASK_PROCESS_OOM_KILLED for memory it never used."""

    async def scenario() -> None:
        pool = ExecutorPool("tests.unit.big_tasks")
        try:
            ex = await pool.acquire()
            fresh = ex.rss_mb()
            assert (await ex.run(_run("hoards-memory", 300), max_duration_s=60, memory_mb=None))["ok"]
            assert ex.rss_mb() > fresh + 250
            pool.release(ex)
            limit = int(fresh) + 150  # room for a fresh executor, not for the 300 MiB left behind
            nxt = await pool.acquire(memory_mb=limit)
            # long enough for the watchdog to look at its memory (every 0.1 s)
            out = await nxt.run(_run("sleeps", 0.5), max_duration_s=60, memory_mb=limit)
            assert out == {"ok": True, "output": "slept"}
            pool.release(nxt)
        finally:
            pool.close()

    _in_loop(scenario())
