"""A wait on a waitpoint that retention deletes: the worker API's wait on a run looked up the run's
(completed, old) waitpoint, then blocked on it in another statement. Retention deleting it between
the two left a journal entry naming a waitpoint that no longer existed: the block found nothing
pending, so the run was not blocked, yet the entry never resolved, and the run stayed EXECUTING
for good (its executor waiting for a result that never came). A journal entry now never names a
deleted waitpoint (the block locks the waitpoint it names, retention checks again under its own
lock), a wait on a run whose waitpoint went makes the run's waitpoint again, and an entry
written before, whose waitpoint is gone, replays as the run's outcome or a clear error."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest

from .conftest import Harness, api_client
from .test_wait_on_ancestry import W, req, start


@pytest.fixture
async def worker(h: Harness) -> Any:
    async with api_client(h, h.env.worker_group_token) as c:
        yield c


async def finished_target_and_waiter(h: Harness, output: Any) -> tuple[str, str, str, str]:
    """A run finished with ``output`` whose RUN waitpoint is made and completed (someone waited on
    it), and an executing run: (target, its waitpoint, waiter, the waiter's snapshot)."""
    target = (await h.engine.trigger(req(h))).id
    at = await start(h, target)
    wp = await h.engine.run_waitpoint(h.env.env_id, target)
    await h.engine.complete_attempt(target, at[target], ok=True, output=output)
    assert (await h.engine.get_waitpoint(wp.id)).status == "COMPLETED"  # type: ignore[union-attr]
    waiter = (await h.engine.trigger(req(h))).id
    at = await start(h, waiter)
    return target, wp.id, waiter, at[waiter]


async def delete_waitpoint(database_url: str, waitpoint_id: str) -> None:
    """What retention does to a completed waitpoint past its age that no journal entry or blocking
    row names (this one only: other tests share the database)."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute("DELETE FROM waitpoint WHERE id = %s", (waitpoint_id,))


async def journaled_waitpoint_exists(database_url: str, run_id: str, sequence: int) -> bool:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        cur = await conn.execute("SELECT EXISTS (SELECT 1 FROM waitpoint w WHERE w.id = j.waitpoint_id)"
                                 " FROM task_run_journal j WHERE j.run_id = %s AND j.sequence = %s",
                                 (run_id, sequence))
        row = await cur.fetchone()
        assert row is not None, "no journal entry"
        return bool(row[0])


async def test_a_wait_on_a_run_whose_waitpoint_retention_deletes_before_the_block_resolves(
        h: Harness, worker: Any, database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    target, wp_id, waiter, snapshot = await finished_target_and_waiter(h, {"n": 1})
    real_block: Callable[..., Awaitable[Any]] = h.engine.block
    deleted: list[str] = []

    async def block_after_retention(*args: Any, **kw: Any) -> Any:
        if not deleted:  # retention runs between the look-up and the block
            deleted.append(kw["waitpoint_ids"][0])
            await delete_waitpoint(database_url, kw["waitpoint_ids"][0])
        return await real_block(*args, **kw)

    monkeypatch.setattr(h.engine, "block", block_after_retention)
    r = await worker.post(f"{W}/runs/{waiter}/snapshots/{snapshot}/waitpoints/{target}/wait",
                          json={"sequence": 0, "kind": "token"})
    assert deleted == [wp_id]
    assert r.status_code == 200, r.text
    data = r.json()
    # before: blocked false with an entry never resolved, the run EXECUTING for good
    assert data["blocked"] is False and data["entry"]["resolved"] is True, data
    assert data["entry"]["result"] == {"ok": True, "output": {"n": 1}}
    assert data["waitpointId"] != wp_id  # the run's waitpoint, made again (completed at once)
    assert await journaled_waitpoint_exists(database_url, waiter, 0)
    assert (await h.engine.latest_snapshot(waiter)).engine_status == "EXECUTING"
    entry = (await h.engine.resolved_journal(waiter)).entries[0]
    assert entry["resolved"] and entry["result"] == {"ok": True, "output": {"n": 1}}


async def test_a_block_waits_for_retention_holding_its_waitpoint_and_never_journals_it_deleted(
        h: Harness, worker: Any, database_url: str) -> None:
    """Retention's delete has the waitpoint locked when the wait's block comes: the block waits for
    it, and finds it gone (the run's waitpoint is made again), instead of journaling it."""
    target, wp_id, waiter, snapshot = await finished_target_and_waiter(h, "out")
    async with await psycopg.AsyncConnection.connect(database_url) as retention:
        await retention.execute("SELECT id FROM waitpoint WHERE id = %s FOR UPDATE", (wp_id,))
        cur = await retention.execute("SELECT pg_backend_pid()")
        row = await cur.fetchone()
        assert row is not None
        pid = row[0]
        wait = asyncio.create_task(worker.post(f"{W}/runs/{waiter}/snapshots/{snapshot}/waitpoints/{target}/wait",
                                               json={"sequence": 0, "kind": "token"}))
        waiting = False
        deadline = asyncio.get_running_loop().time() + 10
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as watch:
            while not wait.done() and asyncio.get_running_loop().time() < deadline:
                cur = await watch.execute("SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
                                          (pid,))
                row = await cur.fetchone()
                if row is not None and row[0] > 0:
                    waiting = True
                    break
                await asyncio.sleep(0.02)
        await retention.execute("DELETE FROM waitpoint WHERE id = %s", (wp_id,))
        await retention.commit()
    r = await wait
    assert waiting  # before: the block did not wait, and journaled the waitpoint retention then deleted
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["blocked"] is False and data["entry"]["resolved"] is True, data
    assert data["entry"]["result"] == {"ok": True, "output": "out"}
    assert await journaled_waitpoint_exists(database_url, waiter, 0)


async def test_a_journaled_wait_whose_waitpoint_is_gone_replays_as_the_run_outcome_or_an_error(
        h: Harness, worker: Any, database_url: str) -> None:
    """Entries written before (the race above) name a waitpoint that is gone: a replay reads the
    run's outcome where the entry names a run that is still there, else an error that says so,
    instead of an entry never resolved (the restored run waited on it for ever)."""
    target, wp_id, waiter, snapshot = await finished_target_and_waiter(h, [1, 2])
    outcome = await h.engine.block(waiter, snapshot, sequence=0, kind="token", key=target, waitpoint_ids=[wp_id])
    assert not outcome.blocked
    token, _ = await h.engine.create_token(h.env.env_id)
    await h.engine.complete_waitpoint(token.id, {"t": 1})
    outcome = await h.engine.block(waiter, outcome.snapshot.id, sequence=1, kind="token", key=token.id,
                                   waitpoint_ids=[token.id], env_id=h.env.env_id)
    assert not outcome.blocked
    gone = (await h.engine.trigger(req(h))).id  # a run deleted with its waitpoint
    at = await start(h, gone)
    gone_wp = await h.engine.run_waitpoint(h.env.env_id, gone)
    await h.engine.complete_attempt(gone, at[gone], ok=True, output="lost")
    outcome = await h.engine.block(waiter, outcome.snapshot.id, sequence=2, kind="token", key=gone,
                                   waitpoint_ids=[gone_wp.id])
    assert not outcome.blocked
    for w in (wp_id, token.id, gone_wp.id):
        await delete_waitpoint(database_url, w)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute("DELETE FROM task_run WHERE id = %s", (gone,))

    r = await worker.get(f"{W}/runs/{waiter}/journal")
    assert r.status_code == 200, r.text
    on_run, on_token, on_gone = r.json()["journal"]
    # before: each {resolved: false, waitpointId}, a replay re-blocking on a waitpoint that is gone
    assert on_run["resolved"] and on_run["result"] == {"ok": True, "output": [1, 2]}, on_run
    assert on_token["resolved"] and on_token["result"]["ok"] is False, on_token
    assert on_token["result"]["error"]["type"] == "WAITPOINT_DELETED", on_token
    assert on_gone["resolved"] and on_gone["result"]["ok"] is False, on_gone
    assert on_gone["result"]["error"]["type"] == "WAITPOINT_DELETED", on_gone
