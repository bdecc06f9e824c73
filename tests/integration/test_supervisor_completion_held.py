"""A finished attempt whose completion the engine cannot take is held by its supervisor, and its
completion retried, for as long as that lasts, its heartbeats going on meanwhile: the run is neither
given up after a deadline nor taken for stalled, so its task, which finished, never runs again.
The worker API and the engine are real (PostgreSQL, Redis); only the executor is faked."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

import supervisor.supervisor as supervisor_module
from run_engine.engine import TriggerRequest
from supervisor.supervisor import WORKER, Reply, Supervisor, SupervisorConfig

from .conftest import Harness, api_client


class _Executor:
    async def run(self, msg: dict[str, Any], **_: Any) -> dict[str, Any]:
        return {"ok": True, "output": {"ran": msg["runId"]}}


class _Pool:
    def __init__(self) -> None:
        self.runs = 0

    async def acquire(self, memory_mb: int | None = None) -> _Executor:
        self.runs += 1
        return _Executor()

    def release(self, _: _Executor) -> None:
        return None


class _Engine:
    """The worker API in process; while ``outage`` is set it answers completions 503 (as a server
    whose PostgreSQL is away would), everything else as it is."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.outage = True
        self.completions_refused = 0
        self.beats = 0

    async def post(self, path: str, json: Any = None) -> Reply:
        if path == "/attempts/complete" and self.outage:
            self.completions_refused += 1
            return Reply(503, {"error": {"code": "service_unavailable", "message": "postgres unavailable"}}, "")
        r = await self.client.post(WORKER + path, json=json)
        if path.endswith("/heartbeat") and r.status_code == 200:
            self.beats += 1
        return Reply(r.status_code, r.json(), r.text[:500])

    async def get(self, path: str) -> Reply:
        r = await self.client.get(WORKER + path)
        return Reply(r.status_code, r.json(), r.text[:500])

    async def close(self) -> None:
        return None


async def _until(predicate: Any, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + 30
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.005)


async def test_a_completion_the_engine_cannot_take_is_held_with_its_heartbeats_until_it_can(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor_module, "COMPLETION_RETRY_FIRST_S", 0.01, raising=False)
    monkeypatch.setattr(supervisor_module, "COMPLETION_RETRY_MAX_S", 0.02, raising=False)
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    async with api_client(h, h.env.worker_group_token) as client:
        # completion_retry_s 0: before, the completion was given up after its first try
        sup = Supervisor(SupervisorConfig(api_url="http://t", token="t", tasks_module="json", concurrency=1,
                                          heartbeat_interval_s=0.01, completion_retry_s=0))
        engine = _Engine(client)
        sup.http = engine  # type: ignore[assignment]
        pool = sup.pool = _Pool()  # type: ignore[assignment]
        answer = await engine.post("/dequeue", {"maxRuns": 1, "waitMs": 0, "workerInstanceName": "A",
                                                "startAttempts": True})
        (item,) = answer.data["runs"]
        assert item["run"]["id"] == run.id
        await sup._slots.acquire()  # handed to its slot, as the run loop does
        sup._executing += 1
        task = asyncio.create_task(sup._handle(item))

        timeout = h.engine.resources.settings.executing_timeout_s
        for _ in range(5):  # five times 0.6 of the heartbeat timeout: taken for stalled without heartbeats
            beats = engine.beats
            await _until(lambda beats=beats: engine.beats > beats or task.done(), "no heartbeat")
            assert not task.done(), "the completion was given up"
            await h.advance(timeout * 0.6)
            latest = await h.engine.latest_snapshot(run.id)
            assert latest.engine_status == "EXECUTING" and latest.attempt_number == 1
        assert engine.completions_refused > 1 and sup.completions_pending == 1
        assert not sup._slots.locked()  # the held completion holds no slot: other runs may start

        engine.outage = False  # the engine can take it again
        await _until(task.done, "the completion was not delivered")
        await task
    done = await h.engine.get_run(run.id)
    assert done is not None and done.status == "COMPLETED" and done.attempt_number == 1
    assert done.output == {"ran": run.id}
    assert pool.runs == 1 and sup.completed == 1 and sup.completions_pending == 0
    assert sup._slots._value == 1 and sup._reporting._value == 1  # each given back once
