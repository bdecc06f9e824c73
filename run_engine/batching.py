"""Coalesce concurrent calls into one round trip (group commit).

Many coroutines call :meth:`Batcher.submit` at about the same time; the batcher hands them to
``flush`` as one list once the event loop yields, with at most ``max_in_flight`` flushes running
at once, so a busy engine sends one statement or one Lua call for many runs while an idle one adds
no delay.

A batch carries the items of many callers, often of many tenants, so one bad item must not fail
the others: when a flush of several callers' items raises, the batch is split in halves and each
half is flushed again, down to single callers, and only the callers whose items fail on their own
get the error (``split=False`` turns this off for flushes that are not safe to repeat). A flush
that fails after its writes committed (a look-up after the statement) says so with
:func:`committed`: its batch is not flushed again, as every run in it would find itself moved on;
each caller gets the error, as if its answer were lost on the way.

One item and many items take the same path: :meth:`Batcher.submit_many` hands a caller's items
over as one group, flushed together (one statement, one Lua call) and never split, so a caller's
items succeed or fail together while other callers' groups are isolated from them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")
log = logging.getLogger(__name__)
COMMITTED = "raised after the batch's writes committed: not flushed again"


@contextlib.contextmanager
def committed() -> Iterator[None]:
    """Around what a flush does after its writes committed: an error raised there is marked (a
    note on the exception, also in its traceback) so that the batcher does not flush the batch
    again."""
    try:
        yield
    except Exception as exc:
        exc.add_note(COMMITTED)
        raise


def is_committed(exc: BaseException) -> bool:
    """Whether ``exc`` was raised after its statement's writes committed (see :func:`committed`)."""
    return COMMITTED in getattr(exc, "__notes__", ())



class Batcher(Generic[T, R]):
    def __init__(
        self,
        flush: Callable[[list[T]], Awaitable[Sequence[R]]],
        *,
        max_batch: int = 200,
        max_in_flight: int = 4,
        split: bool = True,
    ) -> None:
        self._flush = flush
        self._split = split
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        self._pending: deque[tuple[list[T], asyncio.Future[list[R]]]] = deque()
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def drain(self, within_s: float) -> None:
        """Let the flushes under way end (at most ``within_s``), then cancel those still going: a
        stop closes the pools they use next, and a drain outlives its callers by design (a caller
        cancelled, as at a server's stop, leaves the batch to the others waiting on it)."""
        if not self._tasks:
            return
        _, late = await asyncio.wait(set(self._tasks), timeout=within_s)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late)

    async def submit(self, item: T) -> R:
        (result,) = await self.submit_many((item,))
        return result

    async def submit_many(self, items: Sequence[T]) -> list[R]:
        """Flush ``items`` as one group (see the module doc); their results in their order."""
        if not items:
            return []
        return await self.submit_many_now(items)

    def submit_many_now(self, items: Sequence[T]) -> asyncio.Future[list[R]]:
        """:meth:`submit_many`, the items queued before this returns: the future of their results.
        Several such futures run side by side without a task each (``asyncio.gather`` of
        coroutines wraps every one in a task, which is most of what a state change's Redis calls
        cost the engine in Python)."""
        future: asyncio.Future[list[R]] = asyncio.get_running_loop().create_future()
        if not items:
            future.set_result([])
            return future
        self._pending.append((list(items), future))
        self._spawn_drain()
        return future

    def _spawn_drain(self) -> None:
        if self._pending and self._in_flight < self._max_in_flight:
            self._in_flight += 1
            task = asyncio.create_task(self._drain())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        try:
            await asyncio.sleep(0)  # let the other callers of this tick add their items
            while self._pending:
                # whole groups up to max_batch items (a larger group goes alone, unsplit)
                batch = [self._pending.popleft()]
                size = len(batch[0][0])
                while self._pending and size + len(self._pending[0][0]) <= self._max_batch:
                    size += len(self._pending[0][0])
                    batch.append(self._pending.popleft())
                await self._settle(batch)
        finally:
            self._in_flight -= 1
            # A drain stopped by cancellation must not strand the items queued behind its batch:
            # their callers wait on futures that only a drain resolves. Items whose callers are
            # gone (cancelled too, as at shutdown) need no drain.
            if self._pending:
                self._pending = deque(entry for entry in self._pending if not entry[1].done())
                self._spawn_drain()

    async def _settle(self, batch: list[tuple[list[T], asyncio.Future[list[R]]]]) -> None:
        """Flush ``batch`` and resolve its callers; on an error, split it (see the module doc)."""
        try:
            items = [item for group, _ in batch for item in group]
            results = await self._flush(items)
            if len(results) != len(items):
                raise RuntimeError(f"batch flush returned {len(results)} results for {len(items)} items")
        except Exception as exc:
            if self._split and len(batch) > 1 and not is_committed(exc):
                middle = len(batch) // 2
                await self._settle(batch[:middle])
                await self._settle(batch[middle:])
                return
            gone = 0
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
                else:
                    gone += 1
            if gone:  # no caller is left to hear of it (cancelled while it waited): say it here
                log.warning("a batch flush of %s failed after %d of its callers stopped waiting: %r",
                            getattr(self._flush, "__qualname__", self._flush), gone, exc)
            return
        except BaseException as exc:  # cancelled: every caller of the batch learns it, then it propagates
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            raise
        start = 0
        for group, future in batch:
            if not future.done():
                future.set_result(list(results[start:start + len(group)]))
            start += len(group)
