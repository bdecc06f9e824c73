"""A review of the worker API as a hostile or crashing worker sees it: what a dequeue hands out
for a run restored from its checkpoint, and who may journal a step of a run."""

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


async def test_a_step_is_journaled_only_by_an_execution_of_the_run(h: Harness) -> None:
    """The snapshot a completion answers (QUEUED for a retry, FINISHED) is the run's latest, but
    no execution holds it: a step journaled with it was taken (200) and replayed by the next
    attempt as a step it had taken. It is 409 invalid_state now, and nothing is written."""
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    async with api_client(h, h.env.env_worker_group_token) as worker:
        item = await _dequeued(worker, run.id, startAttempts=True)
        snapshot = item["attempt"]["snapshot"]["id"]
        journaled = await worker.post(f"{W}/runs/{run.id}/journal",
                                      json={"snapshotId": snapshot, "sequence": 0, "key": "a", "result": 1})
        assert journaled.status_code == 200, journaled.text  # the execution's own step
        failed = await worker.post(f"{W}/runs/{run.id}/snapshots/{snapshot}/attempts/complete",
                                   json={"ok": False, "error": {"message": "boom"}})
        assert failed.json()["action"] == "retry", failed.text
        queued = failed.json()["snapshotId"]
        late = await worker.post(f"{W}/runs/{run.id}/journal",
                                 json={"snapshotId": queued, "sequence": 1, "key": "b", "result": "injected"})
        assert late.status_code == 409 and late.json()["error"]["code"] == "invalid_state", late.text
        journal = await worker.get(f"{W}/runs/{run.id}/journal")
        assert [e["key"] for e in journal.json()["journal"]] == ["a"]
