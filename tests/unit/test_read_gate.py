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


class Reader:
    """One read of ``key``: in once it has its turn, out when told."""

    def __init__(self, gate: ReadGate, key: str, entered: list[str]) -> None:
        self.key = key
        self.inside = False
        self.release = asyncio.Event()
        self.task = asyncio.create_task(self._read(gate, entered))

    async def _read(self, gate: ReadGate, entered: list[str]) -> None:
        async with gate.turn(self.key):
            entered.append(self.key)
            self.inside = True
            await self.release.wait()
        self.inside = False


async def settle() -> None:
    for _ in range(20):  # the event loop's turns: wake-ups handed on, the woken tasks run
        await asyncio.sleep(0)


async def test_a_key_holding_no_turn_is_served_before_a_busy_key_gets_another() -> None:
    """The turns given back went first come, first served: an environment with reads queued behind
    its turns took the next one before another environment that had none."""
    gate = ReadGate(per_key=2, total=3)
    entered: list[str] = []
    heavy = [Reader(gate, "env_a", entered) for _ in range(4)]
    await settle()
    busy = [Reader(gate, "env_c", entered) for _ in range(4)]
    await settle()
    assert entered == ["env_a", "env_a", "env_c"]
    light = Reader(gate, "env_b", entered)
    await settle()
    assert not light.inside
    heavy[0].release.set()  # one turn given back: env_c holds one and has more queued, env_b none
    await settle()
    assert entered == ["env_a", "env_a", "env_c", "env_b"] and light.inside
    for r in [*heavy, *busy, light]:
        r.release.set()
    await asyncio.gather(*(r.task for r in [*heavy, *busy, light]))
    assert gate._keys == {} and gate._ring == {}


async def test_among_many_backlogs_a_newcomer_waits_for_one_read_of_each_other_key_at_most() -> None:
    """Ten environments with twenty reads queued each and every turn taken: a newcomer's read goes
    in once each of the others has had one more turn at most (it waited behind two reads of each,
    the reads that had passed their environment's share, first come, first served); and whichever
    reads end first (here always the busiest environment's), none takes more than its share."""
    gate = ReadGate(per_key=2, total=4)
    entered: list[str] = []
    readers: list[Reader] = []
    keys = [f"env_{k}" for k in range(10)]
    for key in keys:
        readers += [Reader(gate, key, entered) for _ in range(20)]
        await settle()
    assert entered == ["env_0", "env_0", "env_1", "env_1"]
    light = Reader(gate, "env_new", entered)
    await settle()
    before = len(entered)
    while not light.inside:
        next(r for r in readers if r.inside).release.set()  # the first environments' reads end first
        await settle()
        assert all(sum(r.inside for r in readers if r.key == k) <= 2 for k in keys)
    meanwhile = entered[before:-1]
    assert entered[-1] == "env_new" and len(meanwhile) == len(set(meanwhile)) <= len(keys)
    for r in [*readers, light]:
        r.release.set()
    await asyncio.gather(*(r.task for r in [*readers, light]))
    assert gate._keys == {} and gate._ring == {}


async def test_a_read_cancelled_while_waiting_or_as_its_turn_comes_keeps_no_turn() -> None:
    gate = ReadGate(per_key=1, total=1)
    entered: list[str] = []
    async with gate.turn("env_a"):
        gone = Reader(gate, "env_b", entered)
        next_one = Reader(gate, "env_c", entered)
        await settle()
        gone.task.cancel()  # its turn comes before its task hears of it: the next read takes it
    await settle()
    assert gone.task.cancelled() and next_one.inside and entered == ["env_c"]
    next_one.release.set()
    await next_one.task
    async with gate.turn("env_c"):
        late = Reader(gate, "env_d", entered)
        await settle()
    late.task.cancel()  # given the turn, cancelled before it could use it: the turn is given back
    await settle()
    assert late.task.cancelled() and entered == ["env_c"] and gate._keys == {} and gate._ring == {}
    async with gate.turn("env_e"):
        pass
