"""Retention and the dead-letter queue agree (issue 11): deleted runs leave nothing in Redis, the
DLQ pages past entries that do not match, and a completed waitpoint a live run's journal names is
kept. Through the HTTP routes in process (ASGI), on real PostgreSQL and Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from run_engine.api.app import create_app
from run_engine.api.context import ApiContext
from run_engine.engine import TriggerRequest
from run_engine.run_tokens import RunTokens
from run_engine.wakeups import WakeUps

from .conftest import Harness

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


async def dead_letter(h: Harness, task: str, n: int) -> list[str]:
    """``n`` runs of ``task`` dead-lettered (max_deliveries=1: one undelivered dequeue each), in
    rounds of up to 100 (the environment's concurrency)."""
    ids: list[str] = []
    while len(ids) < n:
        k = min(100, n - len(ids))
        runs = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id=task, payload=i)
                                            for i in range(k)])
        got = await h.engine.dequeue(h.env.worker_group_id, 100)
        assert {d.run.id for d in got} == {r.id for r in runs}
        await h.advance(61)  # PENDING_EXECUTING timed out: past the delivery limit → DLQ
        for run in runs:
            assert (await h.engine.get_run(run.id)).status == "SYSTEM_FAILURE"  # type: ignore[union-attr]
        ids += sorted(r.id for r in runs)  # one time of death: the DLQ orders them by id
    return ids


@pytest.fixture
async def dlq(make_engine) -> AsyncIterator[tuple[Harness, httpx.AsyncClient]]:  # type: ignore[no-untyped-def]
    h: Harness = await make_engine(max_deliveries=1)
    await h.deploy({"id": "hello"}, {"id": "other"})
    ctx = ApiContext(engine=h.engine, tokens=RunTokens("test-secret"),
                     wakeups=WakeUps(h.engine.redis, channel=f"{h.engine.resources.settings.key_prefix}:wake"),
                     public_url="http://t")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)), base_url="http://t",
                                 headers={"Authorization": f"Bearer {h.env.api_key}"}) as client:
        yield h, client


async def test_redrive_all_with_a_filter_pages_past_the_first_hundred(dlq: tuple[Harness, httpx.AsyncClient]) -> None:
    h, client = dlq
    await dead_letter(h, "other", 130)
    wanted = await dead_letter(h, "hello", 5)  # behind 130 entries that do not match
    listed = (await client.get("/api/v1/dlq", params={"filter[taskIdentifier]": "hello"})).json()["data"]
    assert [e["run"]["id"] for e in listed] == wanted
    r = await client.post("/api/v1/dlq/redrive", json={"taskIdentifier": "hello"})
    assert r.status_code == 200 and r.json() == {"redriven": 5}
    assert {(await h.engine.get_run(i)).status for i in wanted} == {"QUEUED"}  # type: ignore[union-attr]
    assert len(await h.engine.resources.queue.list_dlq(h.env.env_id, limit=1000)) == 130


async def test_redrive_all_goes_through_a_bounded_part_of_the_dlq_a_call_and_on_from_its_cursor(
        dlq: tuple[Harness, httpx.AsyncClient], monkeypatch: pytest.MonkeyPatch) -> None:
    """One request went through the whole DLQ: a million entries were minutes of the server every
    tenant shares, at any rate of requests. Now a call walks WALK entries and redrives REDRIVES runs
    at most, and answers `next` to go on from (only then: a call that got through answers as before)."""
    h, client = dlq
    dead = h.engine.systems.dead_letter
    monkeypatch.setattr(dead, "WALK", 150)
    monkeypatch.setattr(dead, "REDRIVES", 4)
    await dead_letter(h, "other", 160)
    wanted = await dead_letter(h, "hello", 6)  # behind 160 entries that do not match
    first = (await client.post("/api/v1/dlq/redrive", json={"taskIdentifier": "hello"})).json()
    assert first["redriven"] == 0 and first["next"]  # walked 150 entries, none matched
    second = (await client.post("/api/v1/dlq/redrive", json={"taskIdentifier": "hello",
                                                             "after": first["next"]})).json()
    assert second["redriven"] == 4 and second["next"]  # as many as a call redrives
    third = (await client.post("/api/v1/dlq/redrive", json={"taskIdentifier": "hello",
                                                            "after": second["next"]})).json()
    assert third == {"redriven": 2}
    assert {(await h.engine.get_run(i)).status for i in wanted} == {"QUEUED"}  # type: ignore[union-attr]
    bad = await client.post("/api/v1/dlq/redrive", json={"after": "12x|run_1"})
    assert bad.status_code == 400 and "after" in bad.json()["error"]["message"]


async def test_dlq_pages_stay_in_place_when_entries_leave(dlq: tuple[Harness, httpx.AsyncClient]) -> None:
    h, client = dlq
    ids = await dead_letter(h, "other", 12)
    queue = h.engine.resources.queue
    first = await queue.list_dlq(h.env.env_id, limit=5)
    assert [e.run_id for e in first] == ids[:5]
    await h.engine.redrive(h.env.env_id, ids[4])  # the cursor's own entry leaves the DLQ
    second = await queue.list_dlq(h.env.env_id, limit=5, after=first[-1])
    assert [e.run_id for e in second] == ids[5:10]
    page = (await client.get("/api/v1/dlq", params={"page[size]": 5})).json()
    assert [e["run"]["id"] for e in page["data"]] == ids[:4] + [ids[5]]
    nxt = (await client.get("/api/v1/dlq", params={"page[size]": 5, "page[after]": page["pagination"]["next"]})).json()
    assert [e["run"]["id"] for e in nxt["data"]] == ids[6:11]


async def test_retention_removes_what_redis_holds_of_deleted_runs(make_engine) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await make_engine(max_deliveries=1, retention_days=1e-9)
    await h.deploy({"id": "hello"})
    ids = await dead_letter(h, "hello", 3)
    assert len(await h.engine.resources.queue.list_dlq(h.env.env_id)) == 3
    assert await h.engine.systems.reconciler.retention() >= 3
    assert await h.engine.get_run(ids[0]) is None
    assert await h.engine.resources.queue.list_dlq(h.env.env_id) == []
    for run_id in ids:
        assert await h.engine.resources.queue.inspect(h.env.env_id, run_id) is None  # message gone too


async def test_retention_leaves_a_run_a_redrive_reopened_while_its_statement_ran(
        make_engine, database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Retention picks its runs in subqueries and locks them after: a run a redrive reopened in
    between was locked in its new version (PostgreSQL checks again only the outer conditions) and
    deleted, a QUEUED run gone after the redrive said yes. Here the statement is held on an advisory
    lock (its snapshot taken) while the redrive commits."""
    import asyncio
    import secrets

    import psycopg

    from run_engine.db import maintenance

    h: Harness = await make_engine(max_deliveries=1, retention_days=1e-9)
    await h.deploy({"id": "hello"})
    (run_id,) = await dead_letter(h, "hello", 1)
    key = secrets.randbelow(2**31 - 1) + 1
    held = maintenance._RUN_WALKS["runs"].replace(
        "WHERE r.finished_at IS NOT NULL AND r.idempotency_key IS NULL",
        f"WHERE (SELECT pg_advisory_xact_lock_shared({key})) IS NOT NULL"
        " AND r.finished_at IS NOT NULL AND r.idempotency_key IS NULL", 1)
    assert held != maintenance._RUN_WALKS["runs"]
    monkeypatch.setitem(maintenance._RUN_WALKS, "runs", held)
    gate = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
    try:
        await gate.execute("SELECT pg_advisory_lock(%s)", (key,))
        retention = asyncio.create_task(h.engine.systems.reconciler.retention())
        deadline = asyncio.get_running_loop().time() + 60
        while not (await (await gate.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = %s AND NOT granted",
                (key,))).fetchone())[0]:  # type: ignore[index]
            assert asyncio.get_running_loop().time() < deadline, "retention never reached its lock"
            await asyncio.sleep(0.02)
        await h.engine.redrive(h.env.env_id, run_id)
        await gate.execute("SELECT pg_advisory_unlock(%s)", (key,))
        await retention
    finally:
        await gate.close()
    run = await h.engine.get_run(run_id)
    assert run is not None and run.status == "QUEUED"
    assert await h.engine.resources.queue.inspect(h.env.env_id, run_id) is not None


async def test_dlq_entries_of_runs_deleted_earlier_are_dropped_not_404(dlq: tuple[Harness, httpx.AsyncClient]) -> None:
    """Entries left by a retention that did not clean Redis (an older version, or a crash)."""
    h, client = dlq
    ids = await dead_letter(h, "hello", 4)

    async def delete_rows(run_id: str) -> None:
        async with h.engine.resources.repo.pool.connection() as conn:
            await conn.execute("DELETE FROM task_run WHERE id = %s", (run_id,))

    await delete_rows(ids[0])
    listed = (await client.get("/api/v1/dlq")).json()["data"]
    assert [e["run"]["id"] for e in listed] == ids[1:]
    assert [e.run_id for e in await h.engine.resources.queue.list_dlq(h.env.env_id)] == ids[1:]
    await delete_rows(ids[1])
    r = await client.post("/api/v1/dlq/redrive")
    assert r.status_code == 200 and r.json() == {"redriven": 2}
    assert await h.engine.resources.queue.list_dlq(h.env.env_id) == []


async def test_retention_keeps_a_completed_waitpoint_a_live_journal_names(make_engine) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await make_engine(retention_days=1e-9)
    await h.deploy({"id": "hello"})
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1)
    s = await h.engine.start_attempt(run.id, d.snapshot.id)
    token, _ = await h.engine.waitpoints.create_token(h.env.env_id, timeout_s=3600)
    loose, _ = await h.engine.waitpoints.create_token(h.env.env_id, timeout_s=3600)
    out = await h.engine.block(run.id, s.snapshot.id, sequence=0, kind="token", key=token.id,
                               waitpoint_ids=[token.id])
    assert out.blocked
    assert await h.engine.waitpoints.complete(token.id, {"approved": True})
    assert await h.engine.waitpoints.complete(loose.id, "nobody waits")
    await h.engine.systems.reconciler.retention()
    assert await h.engine.resources.repo.waitpoints.get(loose.id) is None  # completed and unneeded: gone
    assert await h.engine.resources.repo.waitpoints.get(token.id) is not None
    journal = (await h.engine.waitpoints.resolved_journal(run.id)).entries
    assert journal == [{"sequence": 0, "kind": "token", "key": token.id, "resolved": True,
                        "result": {"ok": True, "output": {"approved": True}}}]


async def test_a_redrive_whose_queue_move_fails_is_answered_and_the_reconciler_queues_the_run(
        dlq: tuple[Harness, httpx.AsyncClient], monkeypatch: pytest.MonkeyPatch) -> None:
    h, _ = dlq
    (run_id,) = await dead_letter(h, "hello", 1)
    queue = h.engine.resources.queue

    async def lost(*args: object) -> bool:
        raise ConnectionError("Redis went away after the commit")

    monkeypatch.setattr(queue, "redrive", lost)
    await h.engine.redrive(h.env.env_id, run_id)  # the QUEUED snapshot stands: answered as redriven
    monkeypatch.undo()
    assert (await h.engine.get_run(run_id)).status == "QUEUED"  # type: ignore[union-attr]
    assert await queue.message_states([(h.env.env_id, run_id)]) == ["dlq"]
    report = await h.engine.systems.reconciler.reconcile(grace_s=-1, full=True)
    assert report.requeued_stuck >= 1
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)
    assert d.run.id == run_id


async def test_a_run_moved_to_the_dlq_by_a_process_that_died_before_failing_it_is_queued_again(
        dlq: tuple[Harness, httpx.AsyncClient], monkeypatch: pytest.MonkeyPatch) -> None:
    h, _ = dlq
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    assert [d.run.id for d in await h.engine.dequeue(h.env.worker_group_id, 5)] == [run.id]
    snapshots = h.engine.systems.dead_letter.execution_snapshot
    real = snapshots.apply

    async def dies_before_the_failure(*args: object, **kwargs: object) -> object:
        if kwargs.get("operation") == "dead-letter":
            raise ConnectionError("the process died here")
        return await real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(snapshots, "apply", dies_before_the_failure)
    await h.advance(61)  # PENDING_EXECUTING timed out: the message goes to the DLQ, the failure is not written
    monkeypatch.undo()
    await h.advance(61)  # the job again: the run moved on (QUEUED), nothing to do
    assert (await h.engine.get_run(run.id)).status == "QUEUED"  # type: ignore[union-attr]
    assert await h.engine.resources.queue.message_states([(h.env.env_id, run.id)]) == ["dlq"]
    await h.engine.systems.reconciler.reconcile(grace_s=-1, full=True)
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)
    assert d.run.id == run.id and d.deliveries <= 1


async def test_retention_keeps_the_children_of_a_run_not_finished_and_runs_whose_key_holds(
        make_engine) -> None:  # type: ignore[no-untyped-def]
    """A batch's results are read from its children's rows whenever its parent replays its journal
    (restored, retried): a child deleted meanwhile read as never created. A run whose idempotency
    key has not expired, deleted, freed the key: the same trigger ran the work again."""
    h: Harness = await make_engine(retention_days=1e-9)
    await h.deploy({"id": "hello"})
    parent = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1)
    started = await h.engine.start_attempt(parent.id, d.snapshot.id)
    children, _ = await h.engine.trigger_and_wait(parent.id, started.snapshot.id, 0, [
        TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=i) for i in range(2)], batch=True)
    for got in await h.engine.dequeue(h.env.worker_group_id, 10):
        s = got.started or await h.engine.start_attempt(got.run.id, got.snapshot.id)
        await h.engine.complete_attempt(got.run.id, s.snapshot.id, ok=True, output=f"out-{got.run.id}")
    keyed = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", idempotency_key="once",
                                                  idempotency_key_ttl_s=3600))
    await h.engine.cancel(keyed.id)
    await h.engine.systems.reconciler.retention()
    assert all([await h.engine.get_run(c) for c in children])  # the parent has not finished
    (entry,) = (await h.engine.waitpoints.resolved_journal(parent.id)).entries
    assert [item["output"] for item in entry["result"]] == [f"out-{c}" for c in children]
    assert await h.engine.get_run(keyed.id) is not None
    again = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", idempotency_key="once"))
    assert again.id == keyed.id and again.is_cached
    h.clock.advance(3700)  # the key expired (PostgreSQL's clock decides: moved by the test's below)
    async with h.engine.resources.repo.pool.connection() as conn:
        await conn.execute("UPDATE task_run SET idempotency_key_expires_at = now() - interval '1 s' WHERE id = %s",
                           (keyed.id,))
    await h.engine.systems.reconciler.retention()
    assert await h.engine.get_run(keyed.id) is None


async def test_a_redriven_run_has_no_ttl_left_to_expire_it(make_engine) -> None:  # type: ignore[no-untyped-def]
    """Its TTL counted from its creation: redriven after it passed, the run expired at the next
    re-arm of its jobs, or ran, whichever came first."""
    h: Harness = await make_engine(max_deliveries=1)
    await h.deploy({"id": "hello"})
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", ttl_s=120))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1)
    await h.advance(61)  # undelivered: DLQ
    assert (await h.engine.get_run(run.id)).status == "SYSTEM_FAILURE"  # type: ignore[union-attr]
    h.clock.advance(3600)
    await h.engine.redrive(h.env.env_id, run.id)
    await h.engine.systems.reconciler.rearm_jobs(grace_s=-1, full=True)
    await h.advance(1)
    assert await h.engine.systems.delayed_runs.expire(run.id) is False
    after = await h.engine.get_run(run.id)
    assert after is not None and after.status == "QUEUED" and after.ttl_s is None


async def test_retention_keeps_a_completed_token_while_its_key_holds(make_engine) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await make_engine(retention_days=1e-9)
    token, _ = await h.engine.waitpoints.create_token(h.env.env_id, idempotency_key="approval-1",
                                                      idempotency_key_ttl_s=3600)
    assert await h.engine.waitpoints.complete(token.id, "yes")
    await h.engine.systems.reconciler.retention()
    again, cached = await h.engine.waitpoints.create_token(h.env.env_id, idempotency_key="approval-1")
    assert cached and again.id == token.id and again.output == "yes"  # not a new token nobody completes


async def test_redrive_all_keeps_the_entry_of_a_run_on_its_way_in_and_goes_past_a_busy_one(
        make_engine, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A run whose message is in the DLQ but whose SYSTEM_FAILURE is not written yet (a dequeue
    that could not hand it out, between its two writes) keeps its entry: dropped, it would be a
    failed run no DLQ page shows. A run whose lock is busy is skipped; the others are redriven."""
    from run_engine.errors import LockTimeoutError

    h: Harness = await make_engine(max_deliveries=1)
    await h.deploy({"id": "hello"})
    ids = await dead_letter(h, "hello", 2)
    coming = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    (held,) = await h.engine.dequeue(h.env.worker_group_id, 1)
    assert (await h.engine.resources.queue.nack(h.env.env_id, coming.id, h.engine.resources.now_ms())).dead_lettered
    dead = h.engine.systems.dead_letter
    real = dead.redrive

    async def busy_first(env_id: str, run_id: str) -> str:
        if run_id == ids[0]:
            raise LockTimeoutError((run_id,), 15.0, 10)
        return await real(env_id, run_id)

    monkeypatch.setattr(dead, "redrive", busy_first)
    assert await dead.redrive_all(h.env.env_id) == (1, None)  # ids[1]; ids[0] busy; `coming` not dead yet
    assert {e.run_id for e in await h.engine.resources.queue.list_dlq(h.env.env_id)} == {ids[0], coming.id}


async def batch_row(h: Harness, batch_id: str) -> bool:
    async with h.engine.resources.repo.pool.connection() as conn:
        cur = await conn.execute("SELECT 1 FROM batch_task_run WHERE id = %s", (batch_id,))
        return await cur.fetchone() is not None


async def run_all(h: Harness) -> None:
    while got := await h.engine.dequeue(h.env.worker_group_id, 10):
        for d in got:
            s = d.started or await h.engine.start_attempt(d.run.id, d.snapshot.id)
            await h.engine.complete_attempt(d.run.id, s.snapshot.id, ok=True)


async def test_retention_deletes_batches_and_their_runs_once_nobody_needs_them(make_engine) -> None:  # type: ignore[no-untyped-def]
    """A batch's row stayed for ever, and so did the runs of every batch nobody waits on (their
    batch, never marked completed, looked still waited on): retention deleted none of a
    batchTrigger's runs. Now such runs and their batch go; a batch whose idempotency key holds
    keeps its runs (a retried request would make those missing again), and a batch a parent not
    finished waits on keeps its children."""
    h: Harness = await make_engine(retention_days=1e-9)
    await h.deploy({"id": "hello"})
    env = h.env.env_id
    parent = await h.engine.trigger(TriggerRequest(env_id=env, task_id="hello"))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1)
    started = await h.engine.start_attempt(parent.id, d.snapshot.id)
    plain, _, _ = await h.engine.open_batch(env, 2, two_phase=False)
    plain_runs = await h.engine.trigger_many([TriggerRequest(env_id=env, task_id="hello", batch_id=plain)
                                              for _ in range(2)])
    keyed, _, _ = await h.engine.open_batch(env, 1, "nightly", idempotency_key_ttl_s=3600, two_phase=False)
    (keyed_run,) = await h.engine.trigger_many([TriggerRequest(env_id=env, task_id="hello", batch_id=keyed)])
    children, _ = await h.engine.trigger_and_wait(parent.id, started.snapshot.id, 0, [
        TriggerRequest(env_id=env, task_id="hello") for _ in range(2)], batch=True)
    await run_all(h)  # the parent resumes but does not finish
    of_parent = (await h.engine.get_run(children[0])).batch_id  # type: ignore[union-attr]
    assert of_parent is not None
    await h.engine.systems.reconciler.retention()
    assert [await h.engine.get_run(r.id) for r in plain_runs] == [None, None]
    assert not await batch_row(h, plain)
    assert await batch_row(h, keyed) and await h.engine.get_run(keyed_run.id) is not None
    again, _, existed = await h.engine.open_batch(env, 1, "nightly", two_phase=False)
    assert again == keyed and existed
    assert await batch_row(h, of_parent) and all([await h.engine.get_run(c) for c in children])
    async with h.engine.resources.repo.pool.connection() as conn:
        await conn.execute("UPDATE batch_task_run SET idempotency_key_expires_at = now() - interval '1 s' "
                           "WHERE id = %s", (keyed,))
    await h.engine.systems.reconciler.retention()
    assert not await batch_row(h, keyed) and await h.engine.get_run(keyed_run.id) is None
    assert await batch_row(h, of_parent) and all([await h.engine.get_run(c) for c in children])


async def test_deleting_old_batches_keeps_to_the_passs_time(make_engine, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The first pass after the upgrade finds every batch row ever made: it deletes them within the
    pass's time, like runs, and leaves the rest to the next passes (the leader's other duties wait)."""
    import systems.reconciler as reconciler

    h: Harness = await make_engine(retention_days=1e-9, retention_batch=1)
    await h.deploy({"id": "hello"})
    batches = []
    for _ in range(3):
        batch_id, _, _ = await h.engine.open_batch(h.env.env_id, 1, two_phase=False)
        await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", batch_id=batch_id)])
        batches.append(batch_id)
    await run_all(h)
    monkeypatch.setattr(reconciler, "RETENTION_PASS_S", -1.0)  # the pass's time is up at once
    await h.engine.systems.reconciler.retention()
    assert all([await batch_row(h, b) for b in batches])
    monkeypatch.undo()
    for _ in range(10):
        if not any([await batch_row(h, b) for b in batches]):
            break
        await h.engine.systems.reconciler.retention()
    assert not any([await batch_row(h, b) for b in batches])


async def test_redrive_all_refuses_filters_longer_than_any_name(dlq: tuple[Harness, httpx.AsyncClient]) -> None:
    """A task identifier or queue name longer than either can be is a 400 naming the field, not a
    walk of the DLQ comparing megabytes of text with every entry."""
    _, client = dlq
    for field in ("taskIdentifier", "queue"):
        r = await client.post("/api/v1/dlq/redrive", json={field: "x" * 129})
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
        assert (await client.post("/api/v1/dlq/redrive", json={field: "x" * 128})).status_code == 200


async def test_retention_keeps_the_children_of_a_dead_lettered_run_a_redrive_replays(make_engine) -> None:  # type: ignore[no-untyped-def]
    """A run in the DLQ has finished (SYSTEM_FAILURE) but may be redriven, and its redrive replays
    its journal, which reads a batch's results from the children's rows. Retention took the DLQ's
    run for a finished parent and deleted its older children at once: redriven, the run read every
    child of its batch as never created (RUN_NOT_CREATED) instead of their outputs."""
    from .test_waitpoints import started_run

    h: Harness = await make_engine(max_deliveries=1, retention_days=1)
    await h.deploy({"id": "hello"})
    parent, s = await started_run(h)
    children, out = await h.engine.trigger_and_wait(parent.id, s.snapshot.id, 0, [
        TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=i) for i in range(2)], batch=True)
    await h.engine.suspend(parent.id, out.snapshot.id)
    got = await h.engine.dequeue(h.env.worker_group_id, 10)
    assert sorted(d.run.id for d in got) == sorted(children)
    for d in got:
        st = d.started or await h.engine.start_attempt(d.run.id, d.snapshot.id)
        await h.engine.complete_attempt(d.run.id, st.snapshot.id, ok=True, output=f"out-{d.run.id}")
    assert [d.run.id for d in await h.engine.dequeue(h.env.worker_group_id, 10)] == [parent.id]  # never started
    await h.advance(61)
    assert (await h.engine.get_run(parent.id)).status == "SYSTEM_FAILURE"  # type: ignore[union-attr]
    async with h.engine.resources.repo.pool.connection() as conn:  # a long run: its children finished long ago
        await conn.execute("UPDATE task_run SET finished_at = now() - interval '2 days' WHERE id = ANY(%s)",
                           (children,))
    await h.engine.systems.reconciler.retention()
    assert all([await h.engine.get_run(c) for c in children])  # before: deleted
    await h.engine.redrive(h.env.env_id, parent.id)
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 10)
    await h.engine.start_attempt(parent.id, d.snapshot.id)
    (entry,) = (await h.engine.waitpoints.resolved_journal(parent.id)).entries
    assert [item["output"] for item in entry["result"]] == [f"out-{c}" for c in children]
