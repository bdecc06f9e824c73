"""A run gives its supervisor slot back when its executor is done, before its completion is
answered, so that the next dequeue overlaps the report; no more than `concurrency` completions
wait for an answer so, after which a finished run keeps its slot."""

from __future__ import annotations

import asyncio
from typing import Any

from supervisor.supervisor import Supervisor, SupervisorConfig


class Executor:
    async def run(self, msg: dict[str, Any], **_: Any) -> dict[str, Any]:
        return {"ok": True, "output": msg["runId"]}


class Pool:
    def __init__(self) -> None:
        self.busy = 0

    async def acquire(self) -> Executor:
        self.busy += 1
        return Executor()

    def release(self, _: Executor) -> None:
        self.busy -= 1

    async def warm(self, n: int) -> None:
        return None

    def close(self) -> None:
        return None


class Completions:
    """Completions that wait for the test to answer them."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.answer = asyncio.Event()

    async def submit(self, item: dict[str, Any]) -> dict[str, Any]:
        self.sent.append(item["runId"])
        await self.answer.wait()
        return {"ok": True}


def item(run_id: str) -> dict[str, Any]:
    return {"run": {"id": run_id}, "snapshot": {"id": f"snapshot_{run_id}"},
            "attempt": {"ok": True, "snapshot": {"id": f"snapshot_{run_id}"}, "attemptNumber": 1,
                        "payload": {}, "runToken": "t",
                        "run": {"taskIdentifier": "noop", "tags": [], "queue": "task/noop"}}}


async def handed(sup: Supervisor, run: dict[str, Any]) -> asyncio.Task[None]:
    """A dequeued run handed to its slot, as the run loop does."""
    await sup._slots.acquire()
    sup._executing += 1
    sup._none_executing.clear()
    return asyncio.create_task(sup._handle(run))


async def until(predicate: Any) -> None:
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("not reached")


async def test_a_finished_run_frees_its_slot_while_its_completion_is_on_its_way() -> None:
    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json", concurrency=1))
    sup.pool = Pool()  # type: ignore[assignment]
    completions = sup._completions = Completions()  # type: ignore[assignment]
    try:
        first = await handed(sup, item("run_1"))
        await until(lambda: completions.sent == ["run_1"])
        assert not sup._slots.locked()  # the slot is back while run_1's completion waits
        assert sup.pool.busy == 0

        second = await handed(sup, item("run_2"))
        await until(lambda: sup.pool.busy == 0)
        await asyncio.sleep(0.01)
        # one completion (the concurrency) already waits: run_2 keeps its slot until it can report
        assert completions.sent == ["run_1"] and sup._slots.locked()

        completions.answer.set()
        await asyncio.wait_for(asyncio.gather(first, second), 5)
        assert completions.sent == ["run_1", "run_2"] and sup.completed == 2
        assert not sup._slots.locked() and sup._slots._value == 1  # each slot released exactly once
    finally:
        await sup.http.close()


async def test_a_run_that_fails_before_its_executor_returns_its_slot_once() -> None:
    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json", concurrency=2))

    class Broken(Pool):
        async def acquire(self) -> Executor:
            raise RuntimeError("no executor")

    sup.pool = Broken()  # type: ignore[assignment]
    try:
        await (await handed(sup, item("run_1")))  # logged, not raised
        assert sup._slots._value == 2 and sup._executing == 0
    finally:
        await sup.http.close()


async def test_a_dequeue_gathering_freed_slots_goes_once_no_run_holds_one(monkeypatch: Any) -> None:
    """While runs queue for the slots, a freed slot waits for the others (DEQUEUE_GATHER_S), but no
    longer than until every run has given its slot back. Made an hour long here: the second
    dequeue still comes, for both slots."""
    from supervisor import supervisor as module

    monkeypatch.setattr(module, "DEQUEUE_GATHER_S", 3600.0)
    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json", concurrency=2))
    sup.pool = Pool()  # type: ignore[assignment]

    class Answered(Completions):
        async def submit(self, item: dict[str, Any]) -> dict[str, Any]:
            self.sent.append(item["runId"])
            return {"ok": True}

    sup._completions = Answered()  # type: ignore[assignment]
    asked: list[int] = []

    async def dequeue(max_runs: int) -> list[dict[str, Any]]:
        asked.append(max_runs)
        if len(asked) == 1:
            sup._backlog = True
            return [item("run_1"), item("run_2")]
        sup.stop()
        return []

    sup._dequeue = dequeue  # type: ignore[method-assign]
    sup._connect_unless_stopped = lambda: _true()  # type: ignore[method-assign]
    await asyncio.wait_for(sup._run(), 10)
    assert asked == [2, 2]  # the second dequeue took both freed slots, without the hour's wait
    assert sup.completed == 2


async def _true() -> bool:
    return True
