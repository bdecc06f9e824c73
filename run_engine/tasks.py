"""Stopping background tasks within a bound.

Python 3.11's ``asyncio.wait_for`` (used inside redis-py's blocking pool and elsewhere) can swallow
a cancellation that races with its inner future completing (gh-86296, fixed in 3.12); a loop that
retries on ``Exception`` then goes on forever and a shutdown that awaits it hangs. So every
background loop also checks a stop flag, and :func:`stop_task` waits a bounded time.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)


async def stop_task(task: asyncio.Task[object] | None, timeout_s: float = 5.0) -> None:
    """Cancel ``task`` and wait for it to end, at most ``timeout_s`` (then leave it: it is logged)."""
    if task is None or task.done():
        return
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        log.warning("background task %s did not stop within %.0f s; leaving it", task.get_name(), timeout_s)
        return
    if not task.cancelled() and task.exception() is not None:
        log.debug("background task %s ended with %r", task.get_name(), task.exception())
