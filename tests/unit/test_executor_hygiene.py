"""A reused executor starts each run clean: background tasks of the previous run are cancelled
before the next run (which may be another environment's) begins."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os

from run_engine.sdk import task
from run_engine.sdk.runtime import Channel
from supervisor.executor import _run_one, cancel_leftovers

seen_tokens: list[str | None] = []


@task(id="leaves-a-background-task")
async def leaves_a_background_task(payload: object, ctx: object) -> str:
    async def spy() -> None:
        while True:
            await asyncio.sleep(0.01)
            seen_tokens.append(os.environ.get("RUN_ENGINE_RUN_TOKEN"))

    asyncio.get_running_loop().create_task(spy())  # never awaited
    await asyncio.sleep(0.05)
    return "done"


@task(id="plain")
async def plain(payload: object, ctx: object) -> str:
    await asyncio.sleep(0.1)
    return "ok"


def _msg(task_id: str, token: str) -> dict[str, object]:
    return {"type": "run", "runId": "run_x", "task": task_id, "payload": None, "attempt": 1, "tags": [],
            "queue": "q", "runToken": token, "apiUrl": "http://127.0.0.1:1", "journal": []}


def test_background_tasks_of_one_run_do_not_see_the_next_run() -> None:
    parent, child = mp.Pipe()
    loop = asyncio.new_event_loop()
    channel = Channel(child, loop)  # the executor's, for all its runs
    try:
        os.environ["RUN_ENGINE_RUN_TOKEN"] = "rt_first"
        assert loop.run_until_complete(_run_one(_msg("leaves-a-background-task", "rt_first"), channel))["ok"]
        assert cancel_leftovers(loop) == 0  # cancelled, and gone: the executor may be reused
        seen_tokens.clear()
        os.environ["RUN_ENGINE_RUN_TOKEN"] = "rt_second"
        assert loop.run_until_complete(_run_one(_msg("plain", "rt_second"), channel))["ok"]
        assert seen_tokens == []  # the spy of the first run never ran during the second
        assert cancel_leftovers(loop) == 0
    finally:
        os.environ.pop("RUN_ENGINE_RUN_TOKEN", None)
        channel.close()
        loop.close()
        parent.close()
        child.close()


def test_a_task_that_ignores_its_cancellation_is_counted() -> None:
    from tests.unit.big_tasks import ignores_cancellation

    loop = asyncio.new_event_loop()
    try:
        loop.create_task(ignores_cancellation())
        loop.run_until_complete(asyncio.sleep(0.02))
        assert cancel_leftovers(loop, grace_s=0.1) == 1
    finally:
        for t in asyncio.all_tasks(loop):
            t.cancel()
        loop.stop()
        loop.close()


async def _stubborn_run_retires_its_executor() -> None:
    from supervisor.executor import ExecutorPool

    pool = ExecutorPool("tests.unit.big_tasks")  # the module the other executor tests fork with
    try:
        ex = await pool.acquire()
        out = await ex.run(_msg("leaves-a-stubborn-task", "rt_first"), max_duration_s=30, memory_mb=None)
        assert out == {"ok": True, "output": ex.process.pid}  # its result arrives, without the flag
        assert ex.retired
        pool.release(ex)
        nxt = await pool.acquire()  # another process: the stubborn task never sees the next run
        assert nxt is not ex and nxt.process.pid != ex.process.pid
        out = await nxt.run(_msg("shape-async", "rt_second"), max_duration_s=30, memory_mb=None)
        assert out == {"ok": True, "output": None}
        pool.release(nxt)
        assert pool.restarts == 1 and pool.idle == 1
    finally:
        pool.close()


def test_an_executor_whose_run_left_a_task_that_ignores_cancellation_is_not_reused() -> None:
    asyncio.run(_stubborn_run_retires_its_executor())
