"""Shutdown never hangs on a background loop that swallowed its cancellation."""

from __future__ import annotations

import asyncio

from run_engine.tasks import stop_task


async def test_a_loop_that_swallows_cancellation_is_left_after_the_bound() -> None:
    stopping = False

    async def stubborn() -> None:
        while not stopping:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:  # as a library that turns it into an Exception would
                pass

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(stop_task(task, timeout_s=0.2), 5)  # returns although the task lives on
    assert not task.done()
    stopping = True  # the stop flag every loop also checks ends it
    await asyncio.wait_for(task, 5)


async def test_a_well_behaved_task_is_cancelled_and_awaited() -> None:
    task = asyncio.create_task(asyncio.sleep(3600))
    await stop_task(task)
    assert task.cancelled()
    await stop_task(None)
