"""ReadGate: one environment's costly reads wait for their own turns, never for another's."""

from __future__ import annotations

import asyncio

from run_engine.ratelimit import ReadGate


async def _reader(gate: ReadGate, key: str, inside: dict[str, int], peak: dict[str, int],
                  release: asyncio.Event) -> None:
    async with gate.turn(key):
        inside[key] = inside.get(key, 0) + 1
        inside["all"] = inside.get("all", 0) + 1
        for k in (key, "all"):
            peak[k] = max(peak.get(k, 0), inside[k])
        await release.wait()
        inside[key] -= 1
        inside["all"] -= 1


async def test_a_busy_key_holds_its_share_only_and_another_key_reads_meanwhile() -> None:
    gate = ReadGate(per_key=2, total=3)
    inside: dict[str, int] = {}
    peak: dict[str, int] = {}
    slow = asyncio.Event()
    heavy = [asyncio.create_task(_reader(gate, "env_heavy", inside, peak, slow)) for _ in range(20)]
    await asyncio.sleep(0)
    assert inside == {"env_heavy": 2, "all": 2} and gate.waiting_or_reading("env_heavy") == 20
    quick = asyncio.Event()
    quick.set()
    # another environment is served at once, its queue ahead of nobody's
    await asyncio.wait_for(_reader(gate, "env_light", inside, peak, quick), 1)
    slow.set()
    await asyncio.gather(*heavy)
    assert peak == {"env_heavy": 2, "all": 3, "env_light": 1}
    assert gate.waiting_or_reading("env_heavy") == 0 and gate._keys == {}  # nothing kept per key


async def test_the_total_bounds_every_key_together() -> None:
    gate = ReadGate(per_key=2, total=3)
    inside: dict[str, int] = {}
    peak: dict[str, int] = {}
    release = asyncio.Event()
    tasks = [asyncio.create_task(_reader(gate, f"env_{i % 4}", inside, peak, release)) for i in range(16)]
    for _ in range(5):
        await asyncio.sleep(0)
    assert inside["all"] == 3
    release.set()
    await asyncio.gather(*tasks)
    assert peak["all"] == 3 and all(peak[f"env_{i}"] <= 2 for i in range(4))


async def test_a_cancelled_waiter_leaves_nothing_behind() -> None:
    gate = ReadGate(per_key=1, total=1)
    inside: dict[str, int] = {}
    release = asyncio.Event()
    first = asyncio.create_task(_reader(gate, "env_a", inside, {}, release))
    second = asyncio.create_task(_reader(gate, "env_a", inside, {}, release))
    await asyncio.sleep(0)
    second.cancel()
    release.set()
    await first
    assert second.cancelled() or second.done()
    assert gate._keys == {}
    async with gate.turn("env_b"):  # the total turn was given back
        pass
