"""WakeUps keeps no state for keys nobody waits on (a long-poll per run id must not leak)."""

from __future__ import annotations

import asyncio

from run_engine.wakeups import WakeUps


async def test_timed_out_waits_leave_nothing_behind() -> None:
    wakeups = WakeUps(None, channel="c")  # type: ignore[arg-type]  # wait() needs no Redis
    assert await asyncio.gather(*(wakeups.wait(f"run:{i}", 0.001) for i in range(1000))) == [False] * 1000
    assert wakeups._events == {} and wakeups._waiters == {}


async def test_a_wake_reaches_every_waiter_of_the_key() -> None:
    wakeups = WakeUps(None, channel="c")  # type: ignore[arg-type]
    waiters = [asyncio.ensure_future(wakeups.wait("g", 5)) for _ in range(3)]
    other = asyncio.ensure_future(wakeups.wait("h", 0.05))
    await asyncio.sleep(0)
    wakeups._wake_local("g")
    assert await asyncio.gather(*waiters) == [True] * 3
    assert await other is False
    assert wakeups._events == {} and wakeups._waiters == {}
