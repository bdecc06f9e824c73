"""Tasks for tests/unit/test_executor_hostile.py: errors, step results and leftovers a task's code
may produce, which must fail (or finish) its run cleanly and leave its executor fit for the next."""

from __future__ import annotations

import asyncio
import datetime
import os
import signal
import threading
import time
from typing import Any

from run_engine.sdk import task


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this exception cannot be printed")


@task(id="raises-unprintable")
async def raises_unprintable(payload: Any) -> None:
    raise _Unprintable()


@task(id="raises-surrogate")
async def raises_surrogate(payload: Any) -> None:
    raise ValueError("half a character: \ud800")  # not UTF-8: orjson refuses it


@task(id="raises-huge")
async def raises_huge(payload: int) -> None:
    raise ValueError("x" * payload)


@task(id="ok")
async def ok(payload: Any) -> str:
    return "ok"


@task(id="step-of-python-values")
async def step_of_python_values(payload: Any, ctx: Any) -> str:
    """A step whose result JSON stores differently (a date, NaN, a tuple): what the task sees."""
    value = await ctx.step("values", lambda: {"at": datetime.datetime(2024, 1, 2, 3, 4, 5), "nan": float("nan"),
                                              "pair": (1, 2)})
    return repr(value)


@task(id="leaves-a-thread")
async def leaves_a_thread(payload: str) -> str:
    """Starts a thread that outlives the run and writes down the run token it can read."""

    def spy() -> None:
        while True:
            time.sleep(0.01)
            with open(payload, "a") as f:
                f.write(f"{os.environ.get('RUN_ENGINE_RUN_TOKEN')}\n")

    threading.Thread(target=spy, daemon=True).start()
    return "left"


@task(id="uses-a-thread")
async def uses_a_thread(payload: Any) -> str:
    """A thread that ends with the run (asyncio.to_thread): not a leftover."""
    return await asyncio.to_thread(lambda: "joined")


@task(id="leaves-process-state")
async def leaves_process_state(payload: str) -> str:
    os.chdir(payload)
    os.environ["HOSTILE_SECRET"] = "of the first run"
    os.environ["HOME"] = "/changed/by/the/task"
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.setitimer(signal.ITIMER_REAL, 60)  # a SIGALRM a minute from now: in a later run
    return "left"


@task(id="process-state")
async def process_state(payload: Any) -> dict[str, Any]:
    return {"cwd": os.getcwd(), "secret": os.environ.get("HOSTILE_SECRET"), "home": os.environ.get("HOME"),
            "sigterm": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
            "alarm": signal.getitimer(signal.ITIMER_REAL)[0]}


_HOARD: list[bytes] = []


@task(id="hoards-memory")
async def hoards_memory(payload: int) -> int:
    """Keeps ``payload`` MiB in a module global (a cache): the executor's RSS stays up after the run."""
    _HOARD.append(os.urandom(payload * 1024 * 1024))
    return len(_HOARD)


@task(id="sleeps")
async def sleeps(payload: float) -> str:
    await asyncio.sleep(payload)
    return "slept"


@task(id="leaves-a-pool-call")
async def leaves_a_pool_call(payload: Any) -> str:
    """A call in the executor's thread pool (asyncio.to_thread's) not awaited: it goes on after the run."""
    asyncio.get_running_loop().run_in_executor(None, time.sleep, 5)
    return "left"


@task(id="sync-task")
def sync_task(payload: Any) -> str:
    """A sync task: it runs in the executor's thread pool, whose idle thread stays for the next run."""
    return threading.current_thread().name
