"""A review of the worker API as a hostile or crashing worker sees it: what a dequeue hands out
for a run restored from its checkpoint, ..."""

from __future__ import annotations

import time
from typing import Any

import httpx

from run_engine.engine import TriggerRequest

from .conftest import Harness, api_client

W = "/engine/v1/worker-actions"


async def _dequeued(worker: httpx.AsyncClient, run_id: str, **options: Any) -> dict[str, Any]:
    """The dequeue's item of ``run_id`` (polled for, with a deadline)."""
    deadline = time.monotonic() + 10
    while True:
        answer = await worker.post(f"{W}/dequeue", json={"maxRuns": 10, **options})
        assert answer.status_code == 200, answer.text
        for item in answer.json()["runs"]:
            if item["run"]["id"] == run_id:
                return dict(item)
        assert time.monotonic() < deadline, "the run was never handed out"


async def test_a_restored_run_is_handed_out_with_its_own_attempts_number_and_run_token(h: Harness) -> None:
    """A run restored from its checkpoint resumes its attempt (journal replay): the dequeue's
    ``attemptNumber`` and ``runToken`` are that attempt's. They were the next attempt's: the
    token (API.md: the dequeue hands it out for the executor) was 401 for every call of the
    restored execution, and live instead for the attempt after it, should the run be retried."""
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    async with api_client(h, h.env.env_worker_group_token) as worker:
        first = await _dequeued(worker, run.id, startAttempts=True)
        assert first["attempt"]["attemptNumber"] == 1
        token, _ = await h.engine.create_token(h.env.env_id)
        blocked = await worker.post(
            f"{W}/runs/{run.id}/snapshots/{first['attempt']['snapshot']['id']}/waitpoints/{token.id}/wait",
            json={"sequence": 0, "suspend": True})
        assert blocked.status_code == 200 and blocked.json().get("suspended"), blocked.text
        await h.engine.complete_waitpoint(token.id, {"v": 1})
        restored = await _dequeued(worker, run.id)  # not started: the worker starts it itself
        assert restored["run"]["attemptNumber"] == 1
        async with api_client(h, restored["runToken"]) as executor:
            assert (await executor.get(f"/api/v3/runs/{run.id}")).status_code == 401  # not started yet
        started = await worker.post(f"{W}/runs/{run.id}/snapshots/{restored['snapshot']['id']}/attempts/start")
        assert started.status_code == 200, started.text
        assert started.json()["attemptNumber"] == 1
        async with api_client(h, restored["runToken"]) as executor:
            read = await executor.get(f"/api/v3/runs/{run.id}")
            assert read.status_code == 200, read.text
