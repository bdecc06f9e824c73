"""Tasks for tests/unit/test_executor_pipe.py: messages of several megabytes both ways, where
the task module was imported, and a task that writes to its executor's pipe itself."""

from __future__ import annotations

import os
import pickle
from typing import Any

from run_engine.sdk import task


@task(id="big-output")
async def big_output(payload: dict[str, Any], ctx: Any) -> str:
    return "o" * payload["size"]


@task(id="big-step")
async def big_step(payload: dict[str, Any], ctx: Any) -> int:
    """A journaled step whose result travels to the supervisor (or is replayed from the journal)."""
    result = await ctx.step("big", lambda: "s" * payload["size"])
    return len(result)


@task(id="many-items")
async def many_items(payload: dict[str, Any], ctx: Any) -> int:
    items = [{"n": i, "pad": "p" * 2000} for i in range(payload["count"])]
    result = await ctx.step("items", lambda: items)
    return len(result)


IMPORTED_IN = os.getpid()  # the process that imported this module


@task(id="where")
async def where(payload: Any, ctx: Any) -> dict[str, int]:
    return {"imported_in": IMPORTED_IN, "runs_in": os.getpid()}


class _RunsCode:
    """Unpickled, it would run ``touch <path>`` in whoever unpickles it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


@task(id="writes-to-its-pipe")
async def writes_to_its_pipe(payload: dict[str, Any], ctx: Any) -> str:
    """Tenant code that sends a frame of its own over the executor's pipe: a pickle that would run
    code in the supervisor, or bytes that are no JSON."""
    from run_engine.sdk import runtime

    rt = runtime.current()
    assert rt is not None
    frame = pickle.dumps(_RunsCode(payload["marker"])) if payload["kind"] == "pickle" else b"\x00not json"
    rt.channel.conn.send_bytes(frame)
    return "sent"


@task(id="waits-on-a-token")
async def waits_on_a_token(payload: Any, ctx: Any) -> Any:
    from run_engine.sdk import wait

    return await wait.for_token(payload["token"])


@task(id="steps-at-once")
async def steps_at_once(payload: dict[str, Any], ctx: Any) -> list[Any]:
    """Several journaled steps asked at once: their answers may reach the executor together."""
    import asyncio

    return list(await asyncio.gather(*(ctx.step(f"s{i}", lambda i=i: i) for i in range(payload["n"]))))


@task(id="exits-leaving-a-child")
async def exits_leaving_a_child(payload: dict[str, Any], ctx: Any) -> str:
    """The executor forks a child that keeps every descriptor (its pipe to the supervisor too) and
    sleeps, then the executor dies: the pipe stays open, only the process is gone."""
    child = os.fork()
    if child == 0:
        _sleep_then_exit(payload["child_s"])
    fd = os.open(payload["pid_file"], os.O_WRONLY | os.O_CREAT)  # the test ends the child when it is done
    os.write(fd, str(child).encode())
    os._exit(3)


def _sleep_then_exit(seconds: float) -> None:
    import time

    time.sleep(seconds)
    os._exit(0)


@task(id="shape-async-ctx")
async def shape_async_ctx(payload: Any, ctx: Any) -> dict[str, Any]:
    return {"run": ctx.run.id, "attempt": ctx.attempt.number, "task": ctx.task.id, "queue": ctx.queue.name,
            "tags": ctx.run.tags}


@task(id="shape-async")
async def shape_async(payload: Any) -> Any:
    return payload


@task(id="shape-sync-ctx")
def shape_sync_ctx(payload: Any, ctx: Any) -> dict[str, Any]:
    import threading

    return {"run": ctx.run.id, "main_thread": threading.current_thread() is threading.main_thread()}


async def ignores_cancellation() -> None:
    """A background task that ignores its cancellation."""
    import asyncio

    while True:
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            continue


@task(id="leaves-a-stubborn-task")
async def leaves_a_stubborn_task(payload: Any, ctx: Any) -> int:
    """Leaves a task that ignores its cancellation (tests/unit/test_executor_hygiene.py)."""
    import asyncio

    asyncio.get_running_loop().create_task(ignores_cancellation())
    await asyncio.sleep(0)
    return os.getpid()


@task(id="swallows-its-suspension")
async def swallows_its_suspension(payload: dict[str, Any], ctx: Any) -> str:
    """Waits on a token and, told to stop (its run was suspended), goes on anyway."""
    import asyncio

    from run_engine.sdk import wait

    try:
        await wait.for_token(payload["token"])
    except BaseException:  # noqa: BLE001 - the point: a task that ignores its suspension
        pass
    await asyncio.sleep(30)
    return "ran on"


@task(id="steps-forever")
async def steps_forever(payload: Any, ctx: Any) -> int:
    """Journaled steps back to back, for ever: a message to the supervisor every few milliseconds."""
    n = 0
    while True:
        await ctx.step(f"s{n}", lambda n=n: n)
        n += 1


@task(id="announces-a-huge-frame")
async def announces_a_huge_frame(payload: Any, ctx: Any) -> str:
    """Writes a frame header of 1 GiB itself, then a few bytes, then sleeps: the supervisor must not
    wait for (or buffer) the rest."""
    import asyncio
    import struct

    from run_engine.sdk import runtime

    rt = runtime.current()
    assert rt is not None
    os.write(rt.channel.conn.fileno(), struct.pack("!i", 1 << 30) + b"{" * 1000)
    await asyncio.sleep(30)
    return "never"


@task(id="sync-sleeps")
def sync_sleeps(payload: dict[str, Any], ctx: Any) -> str:
    """A sync task (in a thread) that writes its pid and sleeps."""
    import time

    _write(payload["pid_file"], os.getpid())
    time.sleep(payload["seconds"])
    return "slept"


@task(id="starts-a-subprocess")
async def starts_a_subprocess(payload: dict[str, Any], ctx: Any) -> str:
    """Starts a process of its own (a command line tool, say), writes its pid and waits on it."""
    import asyncio

    proc = await asyncio.create_subprocess_exec("sleep", "30")
    _write(payload["pid_file"], proc.pid)
    await proc.wait()
    return "done"


def _write(path: str, pid: int) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(str(pid))
    os.replace(path + ".tmp", path)  # whole or not there: the test reads it while it is written


@task(id="steps-and-a-wait")
async def steps_and_a_wait(payload: dict[str, Any], ctx: Any) -> Any:
    """Eight steps and a wait at once: the steps are answered only once the wait is (as a child the
    run triggers would complete the token it waits on)."""
    import asyncio

    from run_engine.sdk import wait

    got = await asyncio.gather(*(ctx.step(f"s{i}", lambda i=i: i) for i in range(8)),
                               wait.for_token(payload["token"]))
    return [got[:8], got[8].output]


@task(id="returns-past-its-steps")
async def returns_past_its_steps(payload: Any, ctx: Any) -> str:
    """Starts ten steps it never waits for, then returns: its result must not wait behind them."""
    import asyncio

    for i in range(10):
        asyncio.get_running_loop().create_task(ctx.step(f"bg{i}", lambda i=i: i))
    await asyncio.sleep(0.2)  # every step's call is sent before the result
    return "done"

# the tasks of tests/unit/test_executor_hostile.py, in the module every executor test forks with
# (the fork server is one per process, with the module of the first executor preloaded)
from tests.unit import hostile_tasks  # noqa: E402, F401
