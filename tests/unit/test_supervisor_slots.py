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
        await sup._slots.acquire()  # as the run loop does before its dequeue
        first = asyncio.create_task(sup._handle(item("run_1")))
        await until(lambda: completions.sent == ["run_1"])
        assert not sup._slots.locked()  # the slot is back while run_1's completion waits
        assert sup.pool.busy == 0

        await sup._slots.acquire()
        second = asyncio.create_task(sup._handle(item("run_2")))
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
        await sup._slots.acquire()
        await sup._handle(item("run_1"))  # logged, not raised
        assert sup._slots._value == 2
    finally:
        await sup.http.close()
