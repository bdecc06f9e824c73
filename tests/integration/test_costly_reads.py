"""Reads whose cost a tenant's data decides (run and token lists, realtime shapes, the dashboard's
lists) take turns per environment (ReadGate) and are bounded in time (a statement timeout): one
tenant's reads, however many or slow, cannot stall another's, nor hold a connection for ever. The
hot path (trigger, dequeue, start, complete) takes no turn and no bound."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import psycopg
import pytest

from run_engine.api.context import ApiContext
from run_engine.db import runs as run_storage
from run_engine.db import waitpoints as waitpoint_storage
from run_engine.engine import TriggerRequest
from run_engine.ratelimit import ReadGate
from run_engine.tenancy import ensure_environment

from .conftest import Harness, api_client

DEADLINE_S = 30.0


def ctx_of(client: httpx.AsyncClient) -> ApiContext:
    return client._transport.app.state.ctx  # type: ignore[attr-defined,no-any-return]


async def until(check: Callable[[], bool], *, unless: asyncio.Task[Any] | None = None) -> None:
    """Poll ``check`` until it holds (a deadline, never a sleep as synchronisation)."""
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "not within the deadline"
        assert unless is None or not unless.done(), unless.result()
        await asyncio.sleep(0.01)


async def dashboard(client: httpx.AsyncClient, api_key: str) -> httpx.AsyncClient:
    """``client`` signed in to the dashboard with ``api_key``."""
    form = await client.get("/dashboard/login")
    csrf = re.search(r'name="csrf" value="([^"]+)"', form.text)
    assert csrf, form.text[:500]
    signed = await client.post("/dashboard/login", data={"csrf": csrf.group(1), "apiKey": api_key,
                                                         "next": "/dashboard/queues"})
    assert signed.status_code == 303, signed.text
    return client


class Hog:
    """Reads of an environment holding its two turns until told to stop (a million runs a read)."""

    def __init__(self, gate: ReadGate, env_id: str) -> None:
        self.stop = asyncio.Event()
        self.holding = 0
        self.tasks = [asyncio.create_task(self._hold(gate, env_id)) for _ in range(2)]

    async def _hold(self, gate: ReadGate, env_id: str) -> None:
        async with gate.turn(env_id):
            self.holding += 1
            await self.stop.wait()

    async def __aenter__(self) -> Hog:
        await until(lambda: self.holding == 2)
        return self

    async def __aexit__(self, *_: object) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks)


@pytest.mark.parametrize("path", ["/api/v1/runs?filter[tag]=t", "/dashboard/runs?tag=t", "/dashboard/tokens",
                                  "/dashboard/batches", "/api/v1/queues", "/api/v1/queues?page=1&perPage=10",
                                  "/dashboard/queues"])
async def test_a_tenants_lists_wait_for_its_own_turns_while_anothers_are_answered(
        h: Harness, api: httpx.AsyncClient, path: str) -> None:
    """Run lists (a tag filter may walk every run of the environment) and the dashboard's lists took
    connections with no turn at all: a tenant listing at full speed took the pool from everyone. So
    did the queue lists (a review of the queue endpoints: an environment's 10,000 queues are read and
    each counted in Redis, 0.3 s a list, whatever page is asked for)."""
    gate = ctx_of(api).costly_reads
    other = await ensure_environment(h.engine.resources.repo, secret="test-secret", org="other-org", project="p",
                                     env="dev")
    for env_id in (h.env.env_id, other.env_id):
        await h.engine.trigger_many([TriggerRequest(env_id=env_id, task_id="hello", payload=1, tags=("t",))])
    if path.startswith("/dashboard"):
        await dashboard(api, h.env.api_key)
    async with Hog(gate, h.env.env_id):
        mine = asyncio.create_task(api.get(path))
        await until(lambda: gate.waiting_or_reading(h.env.env_id) == 3, unless=mine)  # it waits for a turn
        async with api_client(h, other.api_key) as theirs:
            if path.startswith("/dashboard"):
                await dashboard(theirs, other.api_key)
            answer = await asyncio.wait_for(theirs.get(path), DEADLINE_S)
        assert answer.status_code == 200, answer.text
        assert not mine.done()
    answer = await asyncio.wait_for(mine, DEADLINE_S)
    assert answer.status_code == 200, answer.text
    if path.startswith("/api/v1/runs"):
        assert [r["tags"] for r in answer.json()["data"]] == [["t"]]
    if path.startswith("/api/v1/queues"):
        assert "task/hello" in {q["name"] for q in answer.json()["data"]}


async def test_a_queue_named_by_its_id_is_read_alone(h: Harness, api: httpx.AsyncClient,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue named by its id (``?type=id``, as Trigger.dev's SDK sends it) was found by reading
    every queue of the environment (10,000: 0.1 s and a connection each time), outside any turn."""
    queue = (await api.get("/api/v1/queues/task%2Fhello")).json()

    async def every_queue(*_: Any) -> Any:
        raise AssertionError("read every queue of the environment")

    monkeypatch.setattr(h.engine.resources.repo.deployments, "list_queues", every_queue)
    by_id = await api.get(f"/api/v1/queues/{queue['id']}?type=id")
    assert by_id.status_code == 200 and by_id.json()["name"] == "task/hello", by_id.text
    paused = await api.post(f"/api/v1/queues/{queue['id']}/pause", json={"action": "pause", "type": "id"})
    assert paused.status_code == 200 and paused.json()["paused"], paused.text
    other = await ensure_environment(h.engine.resources.repo, secret="test-secret", org="other-org", project="p",
                                     env="dev")
    async with api_client(h, other.api_key) as theirs:  # another environment's id is not found
        assert (await theirs.get(f"/api/v1/queues/{queue['id']}?type=id")).status_code == 404
    for junk in ("queue_", "nope", "queue_" + "a" * 100):
        assert (await api.get(f"/api/v1/queues/{junk}?type=id")).status_code == 404


@pytest.fixture
async def slow_reads(make_engine: Callable[..., Any]) -> Harness:
    """An engine whose costly reads may take half a second, over one connection (the one the
    timed-out read used is the one read after)."""
    harness: Harness = await make_engine(costly_read_timeout_s=0.5, db_pool_min=1, db_pool_max=1)
    await harness.deploy({"id": "hello"})
    return harness


@pytest.fixture
async def held(database_url: str) -> AsyncIterator[Callable[[str], Any]]:
    """Takes a table's ACCESS EXCLUSIVE lock on a connection of the test's own, until the test ends:
    every read of the table waits for it, so none can end within its statement timeout."""
    conns: list[psycopg.AsyncConnection[Any]] = []

    async def lock(table: str) -> None:
        conn = await psycopg.AsyncConnection.connect(database_url)  # not autocommit: the lock is kept
        conns.append(conn)
        await conn.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")

    yield lock
    for conn in conns:
        await conn.rollback()
        await conn.close()


@pytest.mark.parametrize(("table", "path"), [
    ("task_run", "/api/v1/runs?filter[tag]=t"),
    ("task_run", "/realtime/v1/runs?tags=t&offset=-1"),
    ("waitpoint", "/api/v1/waitpoints/tokens?filter[tags]=t"),
])
async def test_a_costly_read_past_its_statement_timeout_answers_503_read_timeout(
        slow_reads: Harness, held: Callable[[str], Any], table: str, path: str) -> None:
    """A read that cannot end (here: waiting on a lock; for real, a filter over millions of rows)
    held its turn and its connection for as long as it took: no statement timeout bounded it."""
    h = slow_reads
    await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=1, tags=("t",))])
    async with api_client(h) as api:
        assert (await api.get("/api/v1/queues")).status_code == 200  # the credential cached before the lock
        await held(table)
        answer = await asyncio.wait_for(api.get(path), DEADLINE_S)
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert error["code"] == "read_timeout" and "narrow it" in error["message"], error
        assert answer.headers["Retry-After"]
        assert ctx_of(api).costly_reads.waiting_or_reading(h.env.env_id) == 0  # its turn given back
    async with h.engine.resources.repo.pool.connection() as conn:  # the bound ended with its transaction
        cur = await conn.execute("SHOW statement_timeout")
        assert (await cur.fetchone()) == ("0",)


async def test_the_hot_path_takes_no_read_turn_and_no_read_bound(h: Harness, api: httpx.AsyncClient,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Trigger, dequeue, start and complete over HTTP: no ReadGate turn, no bounded transaction."""
    turns: list[str] = []
    bounded: list[float | None] = []
    real_turn = ReadGate.turn

    def turn(self: ReadGate, key: str) -> Any:
        turns.append(key)
        return real_turn(self, key)

    monkeypatch.setattr(ReadGate, "turn", turn)
    for module in (run_storage, waitpoint_storage):
        real = module.bounded_read

        def spy(pool: Any, timeout_s: float | None, real: Any = real) -> Any:
            bounded.append(timeout_s)
            return real(pool, timeout_s)

        monkeypatch.setattr(module, "bounded_read", spy)
    triggered = await api.post("/api/v1/tasks/hello/trigger", json={"payload": {"n": 1}})
    assert triggered.status_code == 200, triggered.text
    async with httpx.AsyncClient(transport=api._transport, base_url="http://t/engine/v1/worker-actions",
                                 headers={"Authorization": f"Bearer {h.env.worker_group_token}"}) as worker:
        got = await worker.post("/dequeue", json={"maxRuns": 1})
        assert got.status_code == 200, got.text
        (item,) = got.json()["runs"]
        run_id = item["run"]["id"]
        started = await worker.post(f"/runs/{run_id}/snapshots/{item['snapshot']['id']}/attempts/start")
        assert started.status_code == 200, started.text
        done = await worker.post(f"/runs/{run_id}/snapshots/{started.json()['snapshot']['id']}/attempts/complete",
                                 json={"ok": True, "output": {"done": True}})
        assert done.status_code == 200, done.text
    run = await h.engine.get_run(run_id)
    assert run is not None and run.status == "COMPLETED"
    assert turns == [] and bounded == []
    listed = await api.get("/api/v1/runs")  # (the spies see a costly read)
    assert listed.status_code == 200 and turns == [h.env.env_id] and bounded == [5.0]
