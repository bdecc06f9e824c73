"""One run whose dequeue statement fails on its own (its data: a journal too large to replay, say)
does not keep the other runs of the batch, of every tenant, from being handed out: the batch is
split down to it; it goes back to its queue and, past its delivery limit, to the DLQ, ending
SYSTEM_FAILURE. An outage is not split: the whole dequeue fails, nothing written, and its runs go
back to their queues."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from run_engine.db.runs import RunRepository
from run_engine.engine import TriggerRequest

from .conftest import Harness


def failing_for(monkeypatch: pytest.MonkeyPatch, bad: set[str], error: Exception) -> list[int]:
    """dequeue_and_start raises ``error`` for any batch holding a run of ``bad``; the batch sizes."""
    real = RunRepository.dequeue_and_start
    sizes: list[int] = []

    async def patched(self: RunRepository, runs: Any, *args: Any) -> Any:
        sizes.append(len(runs))
        if any(r.run_id in bad for r in runs):
            raise error
        return await real(self, runs, *args)

    monkeypatch.setattr(RunRepository, "dequeue_and_start", patched)
    return sizes


async def test_a_run_whose_dequeue_fails_alone_does_not_hold_back_the_others(
        make_engine, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await make_engine(max_deliveries=2)
    await h.deploy({"id": "hello"})
    runs = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=i)
                                        for i in range(6)])
    bad = runs[2].id
    failing_for(monkeypatch, {bad}, psycopg.errors.ProgramLimitExceeded("total size of jsonb array elements"))
    # its SYSTEM_FAILURE is written under its lock (a redrive or the reconciler between the move of
    # its message to the DLQ and that write would find a QUEUED run with a dead-lettered message)
    from run_engine.locking import _held_here

    dead_letter = h.engine.systems.dead_letter
    real_finish = dead_letter.finish_dead
    locked: list[bool] = []

    async def finish_dead(run_id: str, *args: Any) -> None:
        locked.append(h.engine.resources.locker.key(run_id) in _held_here())
        await real_finish(run_id, *args)

    monkeypatch.setattr(dead_letter, "finish_dead", finish_dead)
    got = await h.engine.dequeue(h.env.worker_group_id, 10, start=True)
    assert sorted(d.run.id for d in got) == sorted(r.id for r in runs if r.id != bad)
    assert all(d.started is not None for d in got)
    assert (await h.engine.get_run(bad)).status == "QUEUED"  # type: ignore[union-attr]
    for _ in range(20):  # its queue's back-off, then it fails on its own again: past the limit
        await h.advance(60)
        assert await h.engine.dequeue(h.env.worker_group_id, 10, start=True) == []
        if (await h.engine.get_run(bad)).status != "QUEUED":  # type: ignore[union-attr]
            break
    dead = await h.engine.get_run(bad)
    assert dead is not None and dead.status == "SYSTEM_FAILURE" and dead.error["code"] == "TASK_RUN_NOT_HANDED_OUT"
    assert [e.run_id for e in await h.engine.resources.queue.list_dlq(h.env.env_id)] == [bad]
    assert locked == [True]


async def test_an_outage_is_not_split(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=i)
                                        for i in range(4)])
    sizes = failing_for(monkeypatch, {r.id for r in runs}, psycopg.OperationalError("server closed the connection"))
    with pytest.raises(psycopg.OperationalError):
        await h.engine.dequeue(h.env.worker_group_id, 10, start=True)
    assert sizes == [4]
    assert {(await h.engine.get_run(r.id)).status for r in runs} == {"QUEUED"}  # type: ignore[union-attr]


def test_a_statement_past_a_postgresql_limit_is_not_an_outage() -> None:
    """psycopg makes class 54 (program limit exceeded) an OperationalError, like a lost connection;
    trying it again fails again, so it is no 503 and no reason not to isolate the run."""
    from run_engine.dependencies import unavailable_dependency

    assert unavailable_dependency(psycopg.errors.ProgramLimitExceeded("jsonb too large")) is None
    assert unavailable_dependency(psycopg.errors.StatementTooComplex("too complex")) is None
    assert unavailable_dependency(psycopg.OperationalError("server closed the connection")) == "postgres"
    assert unavailable_dependency(psycopg.errors.AdminShutdown("terminating connection")) == "postgres"


async def test_an_outage_while_split_hands_out_what_started_and_gives_the_rest_back(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once split, a half may have committed: an outage in another half fails only that half
    (its runs stay QUEUED and go back to their queues), never the call: every run started is handed out."""
    runs = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=i)
                                        for i in range(8)])
    bad, away = runs[1].id, runs[6].id
    real = RunRepository.dequeue_and_start

    async def patched(self: RunRepository, batch: Any, *args: Any) -> Any:
        ids = {r.run_id for r in batch}
        if bad in ids:
            raise psycopg.errors.ProgramLimitExceeded("total size of jsonb array elements")
        if away in ids and len(batch) < 8:
            raise psycopg.OperationalError("server closed the connection")
        return await real(self, batch, *args)

    monkeypatch.setattr(RunRepository, "dequeue_and_start", patched)
    got = await h.engine.dequeue(h.env.worker_group_id, 10, start=True)
    handed = {d.run.id for d in got}
    assert away not in handed and bad not in handed and handed
    statuses = {r.id: (await h.engine.get_run(r.id)).status for r in runs}  # type: ignore[union-attr]
    assert {i for i, s in statuses.items() if s == "EXECUTING"} == handed  # no run started and not handed out
    assert {s for i, s in statuses.items() if i not in handed} == {"QUEUED"}
    seen = await h.engine.resources.queue.inspect(h.env.env_id, away)
    assert seen is not None and seen["message"]["state"] == "ready"  # type: ignore[index]


async def test_a_fault_of_every_run_is_not_blamed_on_each(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run of the batch failing on its own (a read-only standby, a schema mid-deploy) is the
    fault's, not theirs: the call fails and they stay held, none given back or dead-lettered."""
    runs = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=i)
                                        for i in range(4)])
    failing_for(monkeypatch, {r.id for r in runs},
                psycopg.errors.ReadOnlySqlTransaction("cannot execute INSERT in a read-only transaction"))
    with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
        await h.engine.dequeue(h.env.worker_group_id, 10, start=True)
    for r in runs:
        assert (await h.engine.get_run(r.id)).status == "QUEUED"  # type: ignore[union-attr]
        seen = await h.engine.resources.queue.inspect(h.env.env_id, r.id)
        assert seen is not None and seen["message"]["state"] == "held"  # type: ignore[index]  # not given back


async def test_a_failure_after_the_commit_is_not_split(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    from run_engine.batching import committed

    runs = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=i)
                                        for i in range(4)])
    real = RunRepository.dequeue_and_start
    sizes: list[int] = []

    async def patched(self: RunRepository, batch: Any, *args: Any) -> Any:
        sizes.append(len(batch))
        await real(self, batch, *args)
        with committed():
            raise ValueError("could not read the rows back")

    monkeypatch.setattr(RunRepository, "dequeue_and_start", patched)
    with pytest.raises(ValueError):
        await h.engine.dequeue(h.env.worker_group_id, 10, start=True)
    assert sizes == [4]  # started: never tried again (the reconciler re-arms their timeouts)
    assert {(await h.engine.get_run(r.id)).status for r in runs} == {"EXECUTING"}  # type: ignore[union-attr]


async def test_runs_an_outage_kept_from_starting_are_given_back_at_once(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The queue hands runs out before the start statement: when PostgreSQL is down, the runs go
    straight back to their queues, their delivery not counted. Held, each took a slot of its
    environment until the reconciler's scan came round to it: supervisors polling through an
    outage filled the environment's limit, and after it nothing started for many passes."""
    runs = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=i)
                                        for i in range(6)])
    q = h.engine.resources.queue
    await q.set_env_limit(h.env.env_id, 4)
    failing_for(monkeypatch, {r.id for r in runs}, psycopg.OperationalError("server closed the connection"))
    for _ in range(3):  # the supervisors poll on through the outage
        with pytest.raises(psycopg.OperationalError):
            await h.engine.dequeue(h.env.worker_group_id, 2, "S", start=True)
    monkeypatch.undo()  # PostgreSQL is back

    assert await q.running_ids(h.env.env_id) == set()  # no slot of the environment taken
    for r in runs:
        seen = await q.inspect(h.env.env_id, r.id)
        assert seen is not None and seen["message"]["state"] == "ready"  # type: ignore[index]
        assert seen["message"]["deliveries"] == "0"  # type: ignore[index]
    got = await h.engine.dequeue(h.env.worker_group_id, 10, "S", start=True)  # no reconciler pass between
    assert len(got) == 4 and all(d.started is not None and d.deliveries == 1 for d in got)
    assert {d.run.id for d in got} <= {r.id for r in runs}


async def test_runs_an_outage_kept_from_starting_stay_held_when_redis_is_down_too(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Giving them back is best-effort: the dequeue still fails with PostgreSQL's error, and the
    runs stay held for the reconciler."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    runs = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=i)
                                        for i in range(2)])
    failing_for(monkeypatch, {r.id for r in runs}, psycopg.OperationalError("server closed the connection"))

    async def unreachable(*args: Any) -> Any:
        raise RedisConnectionError("Connection refused")

    monkeypatch.setattr(h.engine.resources.queue, "give_back_many", unreachable)
    with pytest.raises(psycopg.OperationalError):
        await h.engine.dequeue(h.env.worker_group_id, 10, start=True)
    assert await h.engine.resources.queue.running_ids(h.env.env_id) == {r.id for r in runs}


async def test_a_half_failing_after_its_commit_does_not_drop_the_halves_started(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once split, a half that fails after its commit (its runs started, their rows not read back)
    keeps its runs for the reconciler, as an unsplit call does; the halves that started are handed
    out to the worker all the same (dropped with that error, they were EXECUTING with nobody
    running them until the reconciler re-armed them and their heartbeat timeout retried them)."""
    from run_engine.batching import committed

    runs = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=i)
                                        for i in range(8)])
    bad, late = runs[1].id, runs[6].id
    real = RunRepository.dequeue_and_start

    async def patched(self: RunRepository, batch: Any, *args: Any) -> Any:
        ids = {r.run_id for r in batch}
        if bad in ids:
            raise psycopg.errors.ProgramLimitExceeded("total size of jsonb array elements")
        out = await real(self, batch, *args)
        if late in ids:
            with committed():
                raise ValueError("could not read the rows back")
        return out

    monkeypatch.setattr(RunRepository, "dequeue_and_start", patched)
    got = await h.engine.dequeue(h.env.worker_group_id, 10, "S", start=True)
    handed = {d.run.id for d in got}
    # the halves: [0 1 | 2 3] [4 5 6 7]; run 1 fails alone, the half of run 6 after its commit
    assert handed == {runs[i].id for i in (0, 2, 3)}
    assert all(d.started is not None for d in got)
    statuses = {r.id: (await h.engine.get_run(r.id)).status for r in runs}  # type: ignore[union-attr]
    assert {i for i, s in statuses.items() if s == "EXECUTING"} == handed | {runs[i].id for i in (4, 5, 6, 7)}
    assert statuses[bad] == "QUEUED"  # given back to its queue, as when nothing else failed
