from __future__ import annotations

import asyncio

import pytest

from run_engine.batching import Batcher


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
