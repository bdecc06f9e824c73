"""A supervisor whose wait went through but whose answer was lost takes the run's moves since as
its own only when they are: its wait and its continuation in place. A restore of the run on another
supervisor keeps the attempt number, so the attempt number cannot tell; the engine's
``sameExecution`` (``GET .../snapshots/latest?since=<snapshot id>``) does."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from run_engine.engine import TriggerRequest
from supervisor.executor import ExecutorPool
from supervisor.supervisor import Reply, RunState, Supervisor, SupervisorConfig

from .conftest import Harness


class _Executor:
    def __init__(self) -> None:
        self.killed = False

    def kill(self) -> None:
        self.killed = True


@pytest.fixture
async def worker_api(h: Harness) -> AsyncIterator[httpx.AsyncClient]:
    from run_engine.api.app import create_app
    from run_engine.api.context import ApiContext
    from run_engine.run_tokens import RunTokens
    from run_engine.wakeups import WakeUps

    ctx = ApiContext(engine=h.engine, tokens=RunTokens("test-secret"),
                     wakeups=WakeUps(h.engine.redis, channel=f"{h.engine.resources.settings.key_prefix}:wake"),
                     public_url="http://t", secret="test-secret")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)),
                                 base_url="http://t/engine/v1/worker-actions",
                                 headers={"Authorization": f"Bearer {h.env.worker_group_token}"}) as c:
        yield c


def _supervisor(client: httpx.AsyncClient) -> Supervisor:
    class Http:
        async def post(self, path: str, json: Any = None) -> Reply:
            r = await client.post(path, json=json)
            return Reply(r.status_code, r.json(), r.text[:500])

        async def get(self, path: str) -> Reply:
            r = await client.get(path)
            return Reply(r.status_code, r.json(), r.text[:500])

    sup = Supervisor.__new__(Supervisor)
    sup.config = SupervisorConfig(api_url="http://t", token="t", tasks_module="m", wait_retry_s=120)
    sup.pool = ExecutorPool("m")
    sup._lent = 0
    sup.http = Http()  # type: ignore[assignment]
    sup._post = sup.http.post  # type: ignore[method-assign]
    return sup


async def _started(h: Harness, worker: str) -> tuple[str, RunState]:
    await h.deploy({"id": "hello"})
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1, worker, start=True)
    assert d.started is not None
    return run.id, RunState(run.id, d.started.snapshot.id, attempt=d.started.attempt_number)


async def _restored_elsewhere(h: Harness, run_id: str, first_token: str) -> str:
    """The engine suspends the blocked run for its silent supervisor (the waiting timeout), the
    token completes, another supervisor restores the run (same attempt), replays, waits on a
    second token that completes at once and goes on in place. Its latest snapshot id."""
    await h.advance(h.engine.resources.settings.executing_timeout_s + 1)
    assert (await h.engine.latest_snapshot(run_id)).engine_status == "SUSPENDED"
    await h.engine.complete_waitpoint(first_token, {"v": 1})
    (b,) = await h.engine.dequeue(h.env.worker_group_id, 1, "B", start=True)
    assert b.started is not None and b.started.snapshot.checkpoint_id is not None
    second, _ = await h.engine.create_token(h.env.env_id)
    await h.engine.block(run_id, b.started.snapshot.id, sequence=1, kind="token", key=second.id,
                         waitpoint_ids=[second.id])
    await h.engine.complete_waitpoint(second.id, {"v": 2})
    latest = await h.engine.latest_snapshot(run_id)
    assert latest.engine_status == "EXECUTING" and latest.attempt_number == b.started.attempt_number
    return latest.id


async def test_a_lost_wait_answer_does_not_adopt_a_restore_on_another_supervisor(
        h: Harness, worker_api: httpx.AsyncClient) -> None:
    sup = _supervisor(worker_api)
    run_id, a = await _started(h, "A")
    first, _ = await h.engine.create_token(h.env.env_id)
    msg = {"sequence": 0, "kind": "token", "waitpointId": first.id}
    await h.engine.block(run_id, a.snapshot_id, sequence=0, kind="token", key=first.id,
                         waitpoint_ids=[first.id])  # A's wait went through; its answer was lost
    await _restored_elsewhere(h, run_id, first.id)
    # A asks again, is refused as stale, and finds its wait in the journal: the moves since are
    # not its own, so it is refused (before: taken as its own, two executions went on)
    assert await sup._written_by_an_earlier_try(a, msg) is None
    # and A's heartbeat, refused, stops A's executor: the run executes elsewhere
    executor = _Executor()
    assert await sup._heartbeat(a, executor) is True and executor.killed


async def test_a_lost_wait_answer_still_adopts_its_own_continuation(
        h: Harness, worker_api: httpx.AsyncClient) -> None:
    sup = _supervisor(worker_api)
    run_id, a = await _started(h, "A")
    token, _ = await h.engine.create_token(h.env.env_id)
    msg = {"sequence": 0, "kind": "token", "waitpointId": token.id}
    await h.engine.block(run_id, a.snapshot_id, sequence=0, kind="token", key=token.id, waitpoint_ids=[token.id])
    blocked = await sup._written_by_an_earlier_try(a, msg)
    assert blocked is not None and blocked.data["blocked"] is True  # blocked on its own wait
    executor = _Executor()
    assert await sup._heartbeat(a, executor) is False and not executor.killed  # its own wait moved it on
    await h.engine.complete_waitpoint(token.id, {"v": 1})  # continued in place meanwhile
    going_on = await sup._written_by_an_earlier_try(a, msg)
    assert going_on is not None and going_on.data["blocked"] is False
    assert going_on.data["entry"]["result"] == {"ok": True, "output": {"v": 1}}
    assert going_on.data["snapshot"]["id"] == (await h.engine.latest_snapshot(run_id)).id


async def test_since_says_which_snapshots_continue_an_execution(h: Harness, worker_api: httpx.AsyncClient) -> None:
    run_id, a = await _started(h, "A")
    reply = await worker_api.get(f"/runs/{run_id}/snapshots/latest?since={a.snapshot_id}")
    assert reply.status_code == 200 and reply.json()["sameExecution"] is True
    token, _ = await h.engine.create_token(h.env.env_id)
    await h.engine.block(run_id, a.snapshot_id, sequence=0, kind="token", key=token.id, waitpoint_ids=[token.id])
    restored = await _restored_elsewhere(h, run_id, token.id)
    answer = (await worker_api.get(f"/runs/{run_id}/snapshots/latest?since={a.snapshot_id}")).json()
    assert answer["snapshot"]["id"] == restored and answer["sameExecution"] is False
    answer = (await worker_api.get(f"/runs/{run_id}/snapshots/latest?since={restored}")).json()
    assert answer["sameExecution"] is True
    for bad in ("nope", "snapshot_" + "x" * 300, "%00"):
        reply = await worker_api.get(f"/runs/{run_id}/snapshots/latest?since={bad}")
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_input"
    unknown = (await worker_api.get(f"/runs/{run_id}/snapshots/latest?since=snapshot_{'a' * 25}")).json()
    assert unknown["sameExecution"] is False
