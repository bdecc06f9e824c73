"""RunLocker (RedLock) against real Redis."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import pytest
import redis.asyncio as aioredis

from run_engine.errors import LockTimeoutError
from run_engine.locking import LockSettings, RunLocker

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)

FAST = LockSettings(duration_s=0.3, extend_before_s=0.15, max_attempts=4, base_delay_s=0.01, max_delay_s=0.05,
                    max_total_wait_s=0.2)


@pytest.fixture
async def locker(redis_client: aioredis.Redis, key_prefix: str, unique: str):  # type: ignore[no-untyped-def]
    lk = RunLocker([redis_client], prefix=f"{key_prefix}:lk{unique}")
    await lk.start()
    yield lk
    await lk.stop()


async def test_mutual_exclusion_between_tasks(locker: RunLocker) -> None:
    inside = 0
    peak = 0

    async def work() -> None:
        nonlocal inside, peak
        async with locker.lock("test", "run_1"):
            inside += 1
            peak = max(peak, inside)
            await asyncio.sleep(0.002)
            inside -= 1

    await asyncio.gather(*(work() for _ in range(20)))
    assert peak == 1


async def test_reentrant_in_one_task_and_nested_other_resources(locker: RunLocker,
                                                                 redis_client: aioredis.Redis) -> None:
    async with locker.lock("outer", "run_a", "run_b"):
        assert locker.is_held("run_a")
        async with locker.lock("inner", "run_b"):  # no deadlock, no round trip
            async with locker.lock("other", "run_c"):
                assert locker.is_held("run_c")
        assert not locker.is_held("run_c")
        assert locker.is_held("run_b")
    assert not locker.is_held("run_a")
    assert await redis_client.keys(f"{locker.prefix}:*") == []


async def test_timeout_error_names_resources_and_attempts(redis_client: aioredis.Redis, key_prefix: str,
                                                          unique: str) -> None:
    holder = RunLocker([redis_client], prefix=f"{key_prefix}:lt{unique}")
    waiter = RunLocker([redis_client], prefix=f"{key_prefix}:lt{unique}", settings=FAST)
    async def wait() -> None:
        async with waiter.lock("wait", "run_x"):
            pass

    async with holder.lock("hold", "run_x"):
        with pytest.raises(LockTimeoutError) as info:
            await asyncio.create_task(wait())  # another task: not re-entrant
    assert info.value.resources == ("run_x",) and info.value.attempts >= 2
    assert "run_x" in str(info.value)


async def test_extension_keeps_a_long_holder_safe(redis_client: aioredis.Redis, key_prefix: str, unique: str) -> None:
    a = RunLocker([redis_client], prefix=f"{key_prefix}:le{unique}", settings=FAST)
    b = RunLocker([redis_client], prefix=f"{key_prefix}:le{unique}", settings=FAST)
    await a.start()
    try:
        async with a.lock("long", "run_y") as handle:
            await asyncio.sleep(1.0)  # > 3 × the 0.3 s TTL
            assert handle is not None and not handle.lost
            async def steal() -> None:
                async with b.lock("steal", "run_y"):
                    pass

            with pytest.raises(LockTimeoutError):
                await asyncio.create_task(steal())
    finally:
        await a.stop()


async def test_release_only_by_the_owner(redis_client: aioredis.Redis, key_prefix: str, unique: str) -> None:
    prefix = f"{key_prefix}:lo{unique}"
    a = RunLocker([redis_client], prefix=prefix, settings=FAST)  # not started: no extension
    async with a.lock("short", "run_z"):
        await asyncio.sleep(0.4)  # expired
        await redis_client.set(f"{prefix}:{{lock}}:run_z", "someone-else", px=5000)
    assert await redis_client.get(f"{prefix}:{{lock}}:run_z") == b"someone-else"


PROCESS = textwrap.dedent("""
    import asyncio, sys
    from run_engine.locking import RunLocker
    from run_engine.redis_connect import connect
    async def main(url, prefix, counter, n):
        r = await connect(url)
        lk = RunLocker([r], prefix=prefix)
        await lk.start()
        for _ in range(n):
            async with lk.lock("count", "run_shared"):
                v = int(await r.get(counter) or 0)
                await asyncio.sleep(0.001)
                await r.set(counter, v + 1)
        await lk.stop()
        await r.aclose()
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
""")


async def test_two_processes_contending_for_one_run(redis_url: str, redis_client: aioredis.Redis,
                                                    key_prefix: str, unique: str) -> None:
    counter = f"{key_prefix}:counter{unique}"
    args = [sys.executable, "-c", PROCESS, redis_url, f"{key_prefix}:lp{unique}", counter, "60"]
    procs = [await asyncio.create_subprocess_exec(*args) for _ in range(2)]
    codes = await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), 60)
    assert codes == [0, 0]
    assert int(await redis_client.get(counter)) == 120  # no lost update: the read-sleep-write was exclusive
    await redis_client.delete(counter)



async def test_a_lock_taken_for_a_caller_cancelled_meanwhile_is_given_back(
        redis_client: aioredis.Redis, key_prefix: str, unique: str) -> None:
    """The caller is cancelled while its attempt waits in the batch; the batch takes the key all the
    same. Nobody held, extended or released it: the run stayed locked until the lease ran out."""
    slow = LockSettings(duration_s=30, extend_before_s=1, max_attempts=100, base_delay_s=0.01, max_delay_s=0.05,
                        max_total_wait_s=3)
    lk = RunLocker([redis_client], prefix=f"{key_prefix}:lk{unique}", settings=slow)
    await lk.start()
    try:
        doomed = asyncio.ensure_future(lk.lock("test", "run_c").__aenter__())
        await asyncio.sleep(0)  # its attempt is queued in the batch
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        async with lk.lock("test", "run_c"):  # given back: not a 30 s wait (LockTimeoutError after 3 s)
            pass
    finally:
        await lk.stop()
