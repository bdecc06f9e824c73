from __future__ import annotations

import asyncio

import pytest

from run_engine.batching import COMMITTED, Batcher, committed


async def test_concurrent_submissions_share_one_flush() -> None:
    calls: list[list[int]] = []

    async def flush(items: list[int]) -> list[int]:
        calls.append(items)
        await asyncio.sleep(0)
        return [i * 10 for i in items]

    batcher: Batcher[int, int] = Batcher(flush, max_in_flight=1)
    results = await asyncio.gather(*(batcher.submit(i) for i in range(25)))
    assert results == [i * 10 for i in range(25)]
    assert len(calls) == 1 and calls[0] == list(range(25))


async def test_max_batch_splits_and_every_caller_gets_its_result() -> None:
    sizes: list[int] = []

    async def flush(items: list[int]) -> list[int]:
        sizes.append(len(items))
        return items

    batcher: Batcher[int, int] = Batcher(flush, max_batch=10, max_in_flight=2)
    assert await asyncio.gather(*(batcher.submit(i) for i in range(35))) == list(range(35))
    assert sum(sizes) == 35 and max(sizes) <= 10


async def test_a_failed_flush_fails_its_callers_only() -> None:
    async def flush(items: list[int]) -> list[int]:
        if 3 in items:
            raise RuntimeError("boom")
        return items

    batcher: Batcher[int, int] = Batcher(flush, max_batch=1, max_in_flight=1)
    results = await asyncio.gather(*(batcher.submit(i) for i in range(5)), return_exceptions=True)
    assert results[:3] == [0, 1, 2] and isinstance(results[3], RuntimeError) and results[4] == 4
    with pytest.raises(RuntimeError):
        await batcher.submit(3)


async def test_one_bad_item_fails_only_its_own_caller_when_batched_with_others() -> None:
    calls: list[list[int]] = []

    async def flush(items: list[int]) -> list[int]:
        calls.append(items)
        if 13 in items or 31 in items:  # like one row that PostgreSQL refuses: the statement fails
            raise ValueError("bad item")
        return [i * 2 for i in items]

    batcher: Batcher[int, int] = Batcher(flush, max_in_flight=1)
    results = await asyncio.gather(*(batcher.submit(i) for i in range(40)), return_exceptions=True)
    for i, r in enumerate(results):
        if i in (13, 31):
            assert isinstance(r, ValueError)
        else:
            assert r == i * 2
    assert calls[0] == list(range(40))
    assert len(calls) < 40  # halving, not one flush per item


async def test_without_split_a_failed_flush_fails_the_whole_batch() -> None:
    async def flush(items: list[int]) -> list[int]:
        if 2 in items:
            raise ValueError("bad item")
        return items

    batcher: Batcher[int, int] = Batcher(flush, max_in_flight=1, split=False)
    results = await asyncio.gather(*(batcher.submit(i) for i in range(4)), return_exceptions=True)
    assert all(isinstance(r, ValueError) for r in results)


async def test_a_flush_that_fails_after_its_commit_is_not_flushed_again() -> None:
    """Flushed again, every item would find its write done already (its run moved on): each
    caller of the batch gets the error instead, as if its answer were lost."""
    calls: list[list[int]] = []

    async def flush(items: list[int]) -> list[int]:
        calls.append(items)
        # the writes of every item commit here; then a look-up for item 2's answer fails
        with committed():
            if 2 in items:
                raise ConnectionError("connection lost after the commit")
        return items

    batcher: Batcher[int, int] = Batcher(flush, max_in_flight=1)
    results = await asyncio.gather(*(batcher.submit(i) for i in range(4)), return_exceptions=True)
    assert calls == [[0, 1, 2, 3]]
    assert all(isinstance(r, ConnectionError) and COMMITTED in r.__notes__ for r in results)
    assert await batcher.submit(7) == 7  # and the batcher goes on


async def test_a_flush_with_the_wrong_number_of_results_fails_its_callers_instead_of_hanging() -> None:
    async def flush(items: list[int]) -> list[int]:
        return items[:-1]

    batcher: Batcher[int, int] = Batcher(flush, max_in_flight=1)
    results = await asyncio.wait_for(asyncio.gather(*(batcher.submit(i) for i in range(3)), return_exceptions=True), 5)
    assert all(isinstance(r, RuntimeError) and "results for" in str(r) for r in results)


async def test_items_queued_behind_a_cancelled_drain_are_still_flushed() -> None:
    started = asyncio.Event()
    calls: list[list[int]] = []

    async def flush(items: list[int]) -> list[int]:
        calls.append(items)
        if len(calls) == 1:
            started.set()
            await asyncio.sleep(3600)  # the first flush hangs until its drain is cancelled
        return [i * 2 for i in items]

    batcher: Batcher[int, int] = Batcher(flush, max_in_flight=1)
    first = asyncio.ensure_future(batcher.submit(1))
    await started.wait()
    later = [asyncio.ensure_future(batcher.submit(i)) for i in (2, 3)]  # queued behind the busy drain
    await asyncio.sleep(0)
    for task in list(batcher._tasks):
        task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await asyncio.wait_for(asyncio.gather(*later), 5) == [4, 6]
    assert calls[1] == [2, 3]


async def test_a_cancelled_drain_whose_queued_callers_are_gone_starts_no_new_drain() -> None:
    started = asyncio.Event()

    async def flush(items: list[int]) -> list[int]:
        started.set()
        await asyncio.sleep(3600)
        return items

    batcher: Batcher[int, int] = Batcher(flush, max_in_flight=1)
    first = asyncio.ensure_future(batcher.submit(1))
    await started.wait()
    queued = asyncio.ensure_future(batcher.submit(2))
    await asyncio.sleep(0)
    queued.cancel()  # as at shutdown: every caller is cancelled, then the drain
    for task in list(batcher._tasks):
        task.cancel()
    await asyncio.gather(first, queued, return_exceptions=True)
    await asyncio.sleep(0)
    assert batcher._tasks == set() and not batcher._pending and batcher._in_flight == 0


async def test_submit_many_is_one_group_flushed_with_others_and_never_split() -> None:
    calls: list[list[int]] = []

    async def flush(items: list[int]) -> list[int]:
        calls.append(items)
        return [i + 100 for i in items]

    batcher: Batcher[int, int] = Batcher(flush, max_batch=4, max_in_flight=1)
    single, group, big = await asyncio.gather(batcher.submit(1), batcher.submit_many([2, 3]),
                                              batcher.submit_many(list(range(10, 16))))
    assert (single, group, big) == (101, [102, 103], list(range(110, 116)))
    # the first flush takes whole groups up to max_batch; the 6-item group goes alone, whole
    assert calls == [[1, 2, 3], list(range(10, 16))]
    assert await batcher.submit_many([]) == []


async def test_a_failing_group_fails_together_and_spares_the_other_callers() -> None:
    async def flush(items: list[int]) -> list[int]:
        if 7 in items:
            raise ValueError("bad item")
        return items

    batcher: Batcher[int, int] = Batcher(flush, max_in_flight=1)
    results = await asyncio.gather(batcher.submit_many([5, 6, 7, 8]), batcher.submit(1), batcher.submit_many([2, 3]),
                                   return_exceptions=True)
    assert isinstance(results[0], ValueError)  # 5, 6 and 8 are not flushed without 7: all or nothing
    assert results[1:] == [1, [2, 3]]


async def test_submit_many_now_queues_the_items_before_it_returns() -> None:
    calls: list[list[int]] = []

    async def flush(items: list[int]) -> list[int]:
        calls.append(items)
        return [-i for i in items]

    batcher: Batcher[int, int] = Batcher(flush, max_in_flight=1)
    first, second = batcher.submit_many_now([1, 2]), batcher.submit_many_now([3])
    assert list(batcher._pending) == [([1, 2], first), ([3], second)]  # queued, not yet flushed
    assert await second == [-3] and await first == [-1, -2]
    assert calls == [[1, 2, 3]]  # both groups in one flush
    empty = batcher.submit_many_now([])
    assert empty.done() and empty.result() == [] and calls == [[1, 2, 3]]


async def test_after_commit_waits_for_every_call_logs_failures_and_starts_all_before_waiting(
        caplog: pytest.LogCaptureFixture) -> None:
    from systems.resources import SystemResources

    async def flush(items: list[int]) -> list[int]:
        if 0 in items:
            raise ConnectionError("Redis is down")
        return items

    batcher: Batcher[int, int] = Batcher(flush, split=False)
    failing, fine = batcher.submit_many_now([0]), Batcher(flush).submit_many_now([1])
    await SystemResources.after_commit("test", failing, fine)
    assert fine.result() == [1] and "test: committed, but a queue or jobs call after it failed" in caplog.text

    # coroutines among several run side by side: the first waits for what the second does
    second_ran = asyncio.Event()

    async def first() -> None:
        await second_ran.wait()

    async def second() -> None:
        second_ran.set()

    await asyncio.wait_for(SystemResources.after_commit("test", first(), second()), 10)
    assert second_ran.is_set()


async def test_after_commit_cancelled_still_logs_what_the_calls_it_did_not_wait_for_failed(
        caplog: pytest.LogCaptureFixture) -> None:
    from systems.resources import SystemResources

    first: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    second: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(SystemResources.after_commit("test", first, second))
    await asyncio.sleep(0)
    waiting.cancel()  # while it waits for the first call
    with pytest.raises(asyncio.CancelledError):
        await waiting
    second.set_exception(ConnectionError("Redis is down"))
    await asyncio.sleep(0)
    assert "test: committed, but a queue or jobs call after it failed" in caplog.text
    assert "Redis is down" in caplog.text


async def test_a_flush_that_fails_after_its_caller_stopped_waiting_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    started = asyncio.Event()
    release = asyncio.Event()

    async def flush(items: list[int]) -> list[int]:
        started.set()
        await release.wait()
        raise RuntimeError("the Redis call failed")

    batcher: Batcher[int, int] = Batcher(flush)
    caller = asyncio.create_task(batcher.submit(1))
    await asyncio.wait_for(started.wait(), 5)
    caller.cancel()  # e.g. after_commit cancelled while it waited for this call
    with pytest.raises(asyncio.CancelledError):
        await caller
    with caplog.at_level("WARNING", logger="run_engine.batching"):
        release.set()
        for _ in range(100):
            if "failed after 1 of its callers stopped waiting" in caplog.text:
                break
            await asyncio.sleep(0.01)
    assert "the Redis call failed" in caplog.text and "flush" in caplog.text


async def test_a_drain_lets_a_flush_its_callers_left_end_and_cancels_one_that_does_not() -> None:
    """A caller cancelled (a request a server's stop cancelled) leaves its batch's flush running:
    a stop drains the batchers before it closes the pools, so that nothing of theirs outlives it
    (a server stopped a second after its start once left a flush running: test_server_shutdown)."""
    release = asyncio.Event()
    flushed: list[list[int]] = []

    async def flush(items: list[int]) -> list[int]:
        await release.wait()
        flushed.append(items)
        return items

    b: Batcher[int, int] = Batcher(flush)
    caller = asyncio.ensure_future(b.submit(1))
    await asyncio.sleep(0.01)
    caller.cancel()
    asyncio.get_running_loop().call_later(0.05, release.set)
    await b.drain(10)
    assert flushed == [[1]] and not b._tasks  # it ended, written

    stuck: Batcher[int, int] = Batcher(lambda items: asyncio.Event().wait())  # type: ignore[arg-type,return-value]
    caller = asyncio.ensure_future(stuck.submit(2))
    await asyncio.sleep(0.01)
    caller.cancel()
    await stuck.drain(0.05)
    assert not stuck._tasks  # cancelled past the bound, none left running
