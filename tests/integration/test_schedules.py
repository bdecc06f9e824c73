"""Cron schedules on real PostgreSQL and Redis with a fake clock: ticks, exactly one run per tick
across engines, activate/deactivate, timezones, declarative schedules."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta

import pytest

from run_engine.engine import TriggerRequest
from run_engine.errors import ValidationError

from .conftest import Harness, api_client

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


@pytest.fixture(autouse=True)
def _drop_schedules_after(database_url: str):  # type: ignore[no-untyped-def]
    """Schedules left active would keep firing from any engine of the session (the e2e server's
    planner runs on the same database)."""
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        start = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
    yield
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DELETE FROM task_schedule WHERE created_at >= %s", (start,))


def ts(h: Harness) -> datetime:
    return datetime.fromtimestamp(h.clock.now(), UTC)


async def runs_of(h: Harness, schedule_id: str) -> list:  # type: ignore[type-arg]
    return await h.engine.resources.repo.runs.list_runs(h.env.env_id, tags=[f"schedule:{schedule_id}"], limit=100)


async def test_a_tick_fires_one_run_with_the_schedule_payload(h: Harness) -> None:
    sched = await h.engine.systems.schedules.upsert(h.env.env_id, task="hello", cron="* * * * *",
                                                   external_id="user-1")
    nxt = sched.next_run_at
    assert nxt > ts(h) and nxt.second == 0
    await h.engine.systems.schedules.fire_due(jitter_s=0)
    assert await runs_of(h, sched.id) == []  # not due yet
    h.clock.advance((nxt - ts(h)).total_seconds())
    await h.engine.systems.schedules.fire_due(jitter_s=0)
    await h.engine.systems.schedules.fire_due(jitter_s=0)  # moved on to the next minute: nothing
    (run,) = await runs_of(h, sched.id)
    assert run.payload["scheduleId"] == sched.id and run.payload["externalId"] == "user-1"
    assert datetime.fromisoformat(run.payload["timestamp"]) == nxt
    after = await h.engine.resources.repo.schedules.get(sched.id)
    assert after is not None and after.last_run_at == nxt and (after.next_run_at - nxt).total_seconds() == 60


async def test_two_engines_firing_the_same_tick_create_one_run(make_engine) -> None:  # type: ignore[no-untyped-def]
    a: Harness = await make_engine()
    b: Harness = await make_engine()
    assert a.env.env_id == b.env.env_id
    await a.deploy({"id": "hello"})
    sched = await a.engine.systems.schedules.upsert(a.env.env_id, task="hello", cron="* * * * *")
    for tick in range(1, 4):
        wait = (sched.next_run_at - ts(a)).total_seconds()
        a.clock.advance(wait)
        b.clock.advance(wait)
        # (other tests' schedules in this database may fire too: count this schedule's runs)
        await asyncio.gather(*(e.engine.systems.schedules.fire_due(jitter_s=0) for e in (a, b, a, b)))
        assert len(await runs_of(a, sched.id)) == tick
        sched = await a.engine.resources.repo.schedules.get(sched.id)  # type: ignore[assignment]
    runs = await runs_of(a, sched.id)
    assert len({r.payload["timestamp"] for r in runs}) == 3


async def test_deactivate_stops_and_activate_restarts_from_now(h: Harness) -> None:
    sched = await h.engine.systems.schedules.upsert(h.env.env_id, task="hello", cron="*/5 * * * *",
                                                   deduplication_key="five")
    off = await h.engine.systems.schedules.set_active(h.env.env_id, sched.id, False)
    assert off.active is False and off.next_run_at is None
    h.clock.advance(3600)
    await h.engine.systems.schedules.fire_due(jitter_s=0)
    assert await runs_of(h, sched.id) == []
    on = await h.engine.systems.schedules.set_active(h.env.env_id, sched.id, True)
    assert on.next_run_at > ts(h) and on.next_run_at.minute % 5 == 0
    # the same deduplication key updates the schedule instead of creating another
    same = await h.engine.systems.schedules.upsert(h.env.env_id, task="hello", cron="0 * * * *",
                                                  deduplication_key="five")
    assert same.id == sched.id and same.cron == "0 * * * *"


async def test_a_tick_due_is_not_skipped_by_an_edit_that_keeps_its_cron(h: Harness) -> None:
    """A tick due and not yet fired (the planner's jitter, a poll away) was skipped by any edit: the
    schedule's next tick was worked out again from now. An edit of its task or external id, or an
    activation of an active schedule, keeps it; a new cron starts from now."""
    schedules = h.engine.systems.schedules
    sched = await schedules.upsert(h.env.env_id, task="hello", cron="* * * * *", external_id="v1")
    due = sched.next_run_at
    h.clock.advance((due - ts(h)).total_seconds() + 1)  # due, not fired yet
    edited = await schedules.update(h.env.env_id, sched.id, task="hello", cron="* * * * *", external_id="v2")
    assert edited.next_run_at == due
    assert (await schedules.set_active(h.env.env_id, sched.id, True)).next_run_at == due
    await schedules.fire_due(jitter_s=0)
    (run,) = await runs_of(h, sched.id)
    assert datetime.fromisoformat(run.payload["timestamp"]) == due and run.payload["externalId"] == "v2"
    h.clock.advance(61)  # the next one is due: a new cron starts from now instead
    moved = await schedules.update(h.env.env_id, sched.id, task="hello", cron="0 0 * * *", external_id="v2")
    assert moved.next_run_at > ts(h) and moved.next_run_at.hour == 0


async def test_an_environment_makes_at_most_its_cap_of_schedules_over_the_api(make_engine) -> None:  # type: ignore[no-untyped-def]
    """Every process's planner reads the due schedules each poll: a tenant making a million made
    every poll of everyone's schedules read them."""
    from run_engine.errors import UnprocessableError

    h: Harness = await make_engine(max_schedules_per_env=3)
    schedules = h.engine.systems.schedules
    made = [await schedules.upsert(h.env.env_id, task="hello", cron="0 * * * *", deduplication_key=f"k{i}")
            for i in range(3)]
    with pytest.raises(UnprocessableError) as refused:
        await schedules.upsert(h.env.env_id, task="hello", cron="0 * * * *", deduplication_key="k3")
    assert refused.value.code == "too_many_schedules"
    with pytest.raises(UnprocessableError):
        await schedules.upsert(h.env.env_id, task="hello", cron="0 * * * *")  # no key: a new one too
    # a key it has is an update, at the cap too
    again = await schedules.upsert(h.env.env_id, task="hello", cron="5 * * * *", deduplication_key="k1")
    assert again.id == made[1].id and again.cron == "5 * * * *"
    await h.engine.resources.repo.schedules.delete(made[0].id, h.env.env_id)
    assert (await schedules.upsert(h.env.env_id, task="hello", cron="0 * * * *", deduplication_key="k3")).id


async def test_timezone_and_bad_input(h: Harness) -> None:
    sched = await h.engine.systems.schedules.upsert(h.env.env_id, task="hello", cron="0 9 * * *",
                                                   timezone="Asia/Tokyo")
    assert sched.next_run_at.astimezone(UTC).hour == 0  # 09:00 in Tokyo is 00:00 UTC
    with pytest.raises(ValidationError, match="^cron"):
        await h.engine.systems.schedules.upsert(h.env.env_id, task="hello", cron="every minute")
    with pytest.raises(ValidationError, match="^timezone"):
        await h.engine.systems.schedules.upsert(h.env.env_id, task="hello", cron="* * * * *", timezone="Nowhere/X")


async def test_declarative_schedules_follow_the_deployment(h: Harness) -> None:
    await h.deploy({"id": "hello"}, {"id": "nightly", "cron": {"pattern": "0 3 * * *", "timezone": "Europe/Paris"}},
                   version="2")
    rows = await h.engine.resources.repo.schedules.page(h.env.env_id, 10, None)
    (decl,) = [r for r in rows if r.type == "DECLARATIVE"]
    assert decl.task_id == "nightly" and decl.timezone == "Europe/Paris"
    await h.deploy({"id": "hello"}, {"id": "nightly", "cron": ""}, version="3")  # cron removed (empty: none)
    assert [r for r in await h.engine.resources.repo.schedules.page(h.env.env_id, 10, None)
            if r.type == "DECLARATIVE"] == []


async def test_a_deployment_with_a_bad_cron_or_twice_the_same_task_is_refused(h: Harness) -> None:
    with pytest.raises(ValidationError, match=r"deployment.tasks.1.cron"):
        await h.deploy({"id": "hello"}, {"id": "nightly", "cron": "61 * * * *"})
    with pytest.raises(ValidationError, match="task ids must be unique"):
        await h.deploy({"id": "hello"}, {"id": "hello"})


async def test_a_refused_tick_is_skipped_not_retried_at_the_head_of_the_due_list(make_engine) -> None:  # type: ignore[no-untyped-def]
    """A full queue refuses the tick's run: the schedule moves on to its next tick (it stayed due,
    first in line before every other tenant's schedules, and was refused again at every poll)."""
    h: Harness = await make_engine(max_queue_length=1)
    await h.deploy({"id": "hello"})
    await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))  # the queue is full now
    sched = await h.engine.systems.schedules.upsert(h.env.env_id, task="hello", cron="* * * * *")
    tick = sched.next_run_at
    h.clock.advance((tick - ts(h)).total_seconds())
    assert await h.engine.systems.schedules.fire_due(jitter_s=0) == 0
    after = await h.engine.resources.repo.schedules.get(sched.id)
    assert after is not None and after.next_run_at > tick and await runs_of(h, sched.id) == []


async def test_a_host_whose_clock_is_an_hour_ahead_fires_nothing_early(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every process plans by the database's time: one whose own clock stepped an hour ahead (a VM
    resumed, NTP gone) must not fire the next hour's ticks now and skip them for the whole cluster."""
    import time

    from systems import schedules

    sched = await h.engine.systems.schedules.upsert(h.env.env_id, task="hello", cron="* * * * *")
    ahead = time.time() + 3600
    monkeypatch.setattr(schedules, "host_time", lambda: time.time() + 3600)
    h.clock.set(ahead)  # the engine's clock is the host's: as far ahead
    assert await h.engine.systems.schedules.fire_due(jitter_s=0) == 0
    assert await runs_of(h, sched.id) == []
    after = await h.engine.resources.repo.schedules.get(sched.id)
    assert after is not None and after.next_run_at == sched.next_run_at  # nothing skipped


async def test_one_environments_many_due_schedules_do_not_hold_back_anothers(
        make_engine, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from run_engine.tenancy import ensure_environment
    from systems import schedules

    monkeypatch.setattr(schedules, "DUE_PER_POLL", 10)
    monkeypatch.setattr(schedules, "DUE_PER_ENVIRONMENT", 4)
    h: Harness = await make_engine()
    busy = [await h.engine.systems.schedules.upsert(h.env.env_id, task="hello", cron="* * * * *")
            for _ in range(30)]
    h.clock.advance(600)  # the busy tenant's ticks are ten minutes overdue: the oldest
    other = await ensure_environment(h.engine.resources.repo, secret="test-secret", org="sched-other", project="p",
                                     env="dev")
    quiet = await h.engine.systems.schedules.upsert(other.env_id, task="hello", cron="* * * * *")
    h.clock.advance((quiet.next_run_at - ts(h)).total_seconds())
    await h.engine.systems.schedules.fire_due(jitter_s=0)
    quiet_runs = await h.engine.resources.repo.runs.list_runs(other.env_id, tags=[f"schedule:{quiet.id}"], limit=10)
    assert len(quiet_runs) == 1  # in the first poll, beside four of the busy tenant's
    fired = [s for s in busy if await runs_of(h, s.id)]
    assert len(fired) == 4


async def test_a_schedule_whose_next_tick_cannot_be_worked_out_is_stopped_not_fired_at_every_poll(
        h: Harness) -> None:
    sched = await h.engine.systems.schedules.upsert(h.env.env_id, task="hello", cron="* * * * *")
    async with h.engine.resources.repo.schedules.pool.connection() as conn:  # a zone this host lacks
        await conn.execute("UPDATE task_schedule SET timezone = 'Gone/Zone' WHERE id = %s", (sched.id,))
    h.clock.advance((sched.next_run_at - ts(h)).total_seconds())
    assert await h.engine.systems.schedules.fire_due(jitter_s=0) == 0
    after = await h.engine.resources.repo.schedules.get(sched.id)
    assert after is not None and after.active is False and after.next_run_at is None
    assert await runs_of(h, sched.id) == []


async def test_a_tick_fires_the_task_the_schedule_has_when_it_fires(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The task changed (same key and cron: the tick kept) between the poll and the firing: the
    tick is the schedule's as it is then, one run of the new task."""
    await h.deploy({"id": "hello"}, {"id": "other"})
    sched = await h.engine.systems.schedules.upsert(h.env.env_id, task="hello", cron="* * * * *",
                                                   deduplication_key="k")
    h.clock.advance((sched.next_run_at - ts(h)).total_seconds())
    repo = h.engine.resources.repo.schedules
    stale = await repo.due(await repo.now() + __import__("datetime").timedelta(hours=1), 200, 200)
    await h.engine.systems.schedules.upsert(h.env.env_id, task="other", cron="* * * * *", deduplication_key="k")

    async def polled(*args: object) -> list:  # type: ignore[type-arg]
        return [r for r in stale if r.id == sched.id]

    monkeypatch.setattr(repo, "due", polled)
    assert await h.engine.systems.schedules.fire_due(jitter_s=0) == 1
    (run,) = await runs_of(h, sched.id)
    assert run.task_id == "other"


async def test_a_schedule_made_over_the_api_cannot_take_a_declarative_key_nor_a_huge_page(h: Harness, api) -> None:  # type: ignore[no-untyped-def]
    made = await api.post("/api/v1/schedules", json={"task": "hello", "cron": "* * * * *",
                                                     "deduplicationKey": "declarative:nightly"})
    assert made.status_code == 400 and "deduplicationKey" in made.text
    for query in ("perPage=" + "9" * 5000, "page=" + "9" * 5000, "page[size]=" + "9" * 5000):
        assert (await api.get(f"/api/v1/schedules?{query}")).status_code == 400, query[:12]
    assert (await api.get("/api/v1/queues?page=" + "9" * 5000)).status_code == 400
    assert (await api.get("/api/v1/runs?page[size]=" + "9" * 5000)).status_code == 400


async def test_a_cron_over_the_api_takes_question_marks_in_its_day_fields_and_refuses_empty_items(  # type: ignore[no-untyped-def]
        h: Harness, api) -> None:
    made = await api.post("/api/v1/schedules", json={"task": "hello", "cron": "0 0 ? * MON"})
    assert made.status_code == 200, made.text
    assert datetime.fromisoformat(made.json()["nextRun"].replace("Z", "+00:00")).isoweekday() == 1
    for cron, words in (("0 , * * *", "empty list item"), ("1,,2 * * * *", "empty list item"),
                        ("/5 * * * *", "a step needs a start"), ("? 0 * * *", "only a whole day-of-month")):
        refused = await api.post("/api/v1/schedules", json={"task": "hello", "cron": cron})
        assert refused.status_code == 400 and "cron" in refused.text and words in refused.text, (cron, refused.text)


async def test_many_busy_environments_do_not_hold_back_a_quiet_tenants_due_tick(
        make_engine, monkeypatch: pytest.MonkeyPatch, unique: str) -> None:  # type: ignore[no-untyped-def]
    """A poll takes each environment's due ticks in turns (every environment's oldest first): busy
    environments whose own share of a poll fills it together (3 x 4 ticks ten minutes late, a poll of
    10) no longer starve a quiet tenant's fresh tick poll after poll (the oldest ticks of all were
    taken first, and a tick fired late skips the ticks it missed)."""
    from run_engine.tenancy import ensure_environment
    from systems import schedules

    monkeypatch.setattr(schedules, "DUE_PER_POLL", 10)
    monkeypatch.setattr(schedules, "DUE_PER_ENVIRONMENT", 4)
    h: Harness = await make_engine()
    repo = h.engine.resources.repo
    busy = [await ensure_environment(repo, secret="test-secret", org=f"busy-{unique}-{i}", project="p", env="dev")
            for i in range(3)]
    made = {env.env_id: [await h.engine.systems.schedules.upsert(env.env_id, task="hello", cron="* * * * *")
                         for _ in range(6)] for env in busy}
    h.clock.advance(600)
    quiet = await h.engine.systems.schedules.upsert(h.env.env_id, task="hello", cron="* * * * *")
    h.clock.advance((quiet.next_run_at - ts(h)).total_seconds() + 1)
    await h.engine.systems.schedules.fire_due(jitter_s=0)
    assert len(await runs_of(h, quiet.id)) == 1  # in the first poll
    for env_id, scheds in made.items():  # the other nine ticks of the poll shared by the busy three
        fired = [s for s in scheds if await repo.runs.list_runs(env_id, tags=[f"schedule:{s.id}"], limit=10)]
        assert len(fired) == 3


@pytest.mark.parametrize("edited", ["before its run is stored", "after its run is stored"])
async def test_a_tick_whose_task_changes_while_it_is_in_flight_makes_one_run(
        make_engine, monkeypatch: pytest.MonkeyPatch, edited: str) -> None:  # type: ignore[no-untyped-def]
    """Process A fires tick T (task hello); meanwhile the schedule's task changes (same cron: the tick
    is kept) and process B fires T for the new task. The idempotency key is unique per (environment,
    task, key): the two runs were both made. The run is stored in the transaction that moves the
    schedule past T, only if the schedule is still as read: one run of T."""
    a: Harness = await make_engine()
    b: Harness = await make_engine()
    await a.deploy({"id": "hello"}, {"id": "other"})
    sched = await a.engine.systems.schedules.upsert(a.env.env_id, task="hello", cron="* * * * *",
                                                   deduplication_key="k")
    tick = sched.next_run_at
    for e in (a, b):
        e.clock.advance((tick - ts(e)).total_seconds())
    enqueue = a.engine.systems.schedules.enqueue
    real = enqueue.trigger_many

    async def edit_and_fire_from_b() -> None:
        await a.engine.systems.schedules.upsert(a.env.env_id, task="other", cron="* * * * *", deduplication_key="k")
        await b.engine.systems.schedules.fire_due(jitter_s=0)

    async def with_edit(requests, **kw):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(enqueue, "trigger_many", real)  # once
        if edited.startswith("before"):
            await edit_and_fire_from_b()
        out = await real(requests, **kw)
        if edited.startswith("after"):
            await edit_and_fire_from_b()
        return out

    monkeypatch.setattr(enqueue, "trigger_many", with_edit)
    await a.engine.systems.schedules.fire_due(jitter_s=0)
    runs = await runs_of(a, sched.id)
    assert [(r.task_id, r.payload["timestamp"]) for r in runs] == [
        ("other" if edited.startswith("before") else "hello", tick.isoformat())]
    after = await a.engine.resources.repo.schedules.get(sched.id)
    assert after is not None and after.last_run_at == tick and after.next_run_at > tick


async def test_a_process_dying_after_a_ticks_run_makes_no_second_run_for_a_new_task(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run was stored, then the process died before moving the schedule past the tick; the task
    was changed before another process fired the tick again: a second run, of the new task. The run
    and the move are one transaction now: nothing is left to fire again."""
    await h.deploy({"id": "hello"}, {"id": "other"})
    sched = await h.engine.systems.schedules.upsert(h.env.env_id, task="hello", cron="* * * * *",
                                                   deduplication_key="k")
    h.clock.advance((sched.next_run_at - ts(h)).total_seconds())
    repo = h.engine.resources.repo.schedules

    async def died(*args: object) -> bool:
        raise ConnectionError("the process died")

    monkeypatch.setattr(repo, "advance", died)
    await h.engine.systems.schedules.fire_due(jitter_s=0)
    monkeypatch.undo()
    await h.engine.systems.schedules.upsert(h.env.env_id, task="other", cron="* * * * *", deduplication_key="k")
    await h.engine.systems.schedules.fire_due(jitter_s=0)
    assert [r.task_id for r in await runs_of(h, sched.id)] == ["hello"]


async def test_a_process_dying_while_it_fires_a_tick_leaves_the_tick_to_fire(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dead with the tick taken and its run inserted but not committed: neither stands, and the next
    poll fires the tick (of the schedule as it is then)."""
    from psycopg.types.json import Jsonb

    from run_engine.db.rows import to_columns
    from run_engine.db.runs import _INSERT_RUNS_SQL

    await h.deploy({"id": "hello"}, {"id": "other"})
    sched = await h.engine.systems.schedules.upsert(h.env.env_id, task="hello", cron="* * * * *",
                                                   deduplication_key="k")
    h.clock.advance((sched.next_run_at - ts(h)).total_seconds())
    runs = h.engine.resources.repo.runs
    real = runs.insert_runs

    async def in_transaction(new_runs, *, guard=None, **kw):  # type: ignore[no-untyped-def]
        async def then_die(conn):  # type: ignore[no-untyped-def]
            await guard(conn)  # the tick taken
            await conn.execute(_INSERT_RUNS_SQL, {"rows": Jsonb([to_columns(r) for r in new_runs])})  # its run
            raise ConnectionError("the process died")
        return await real(new_runs, guard=then_die, **kw)

    monkeypatch.setattr(runs, "insert_runs", in_transaction)
    assert await h.engine.systems.schedules.fire_due(jitter_s=0) == 0
    monkeypatch.undo()
    after = await h.engine.resources.repo.schedules.get(sched.id)
    assert after is not None and after.next_run_at == sched.next_run_at and after.last_run_at is None
    assert await runs_of(h, sched.id) == []
    await h.engine.systems.schedules.upsert(h.env.env_id, task="other", cron="* * * * *", deduplication_key="k")
    assert await h.engine.systems.schedules.fire_due(jitter_s=0) == 1
    assert [r.task_id for r in await runs_of(h, sched.id)] == ["other"]


@pytest.mark.parametrize("action", ["delete", "deactivate"])
async def test_a_schedule_deleted_or_deactivated_while_its_tick_is_in_flight_makes_no_run(
        h: Harness, monkeypatch: pytest.MonkeyPatch, action: str) -> None:
    """Deleted (DELETE answered 200) or deactivated between the poll's read and the tick's trigger:
    the run was made all the same."""
    sched = await h.engine.systems.schedules.upsert(h.env.env_id, task="hello", cron="* * * * *")
    h.clock.advance((sched.next_run_at - ts(h)).total_seconds())
    enqueue = h.engine.systems.schedules.enqueue
    real = enqueue.trigger_many

    async def stopped_first(requests, **kw):  # type: ignore[no-untyped-def]
        if action == "delete":
            assert await h.engine.delete_schedule(sched.id, h.env.env_id)
        else:
            await h.engine.set_schedule_active(h.env.env_id, sched.id, False)
        return await real(requests, **kw)

    monkeypatch.setattr(enqueue, "trigger_many", stopped_first)
    assert await h.engine.systems.schedules.fire_due(jitter_s=0) == 0
    assert await runs_of(h, sched.id) == []


async def test_concurrent_creates_stop_at_the_environments_cap(make_engine, unique: str) -> None:  # type: ignore[no-untyped-def]
    """The cap was counted in each insert: creates at once each saw room for themselves (36 at once
    with a cap of 5 made 6 to 10). The environment's capped creates take turns now (three
    environments: racing creates do not pass the cap every time)."""
    from run_engine.errors import UnprocessableError
    from run_engine.tenancy import ensure_environment

    h: Harness = await make_engine(max_schedules_per_env=5, db_pool_max=16)
    schedules = h.engine.systems.schedules
    for n in range(3):
        env = await ensure_environment(h.engine.resources.repo, secret="test-secret", org=f"cap-{unique}-{n}",
                                       project="p", env="dev")

        async def create(i: int, env_id: str = env.env_id) -> bool:
            try:
                await schedules.upsert(env_id, task="hello", cron="0 * * * *", deduplication_key=f"c{i}")
                return True
            except UnprocessableError:
                return False

        await asyncio.gather(*(create(i) for i in range(4)))
        made = sum(await asyncio.gather(*(create(i) for i in range(4, 40))))
        total, _ = await h.engine.resources.repo.schedules.count(env.env_id)
        assert (made, total) == (1, 5), f"environment {n}"


async def legacy_schedule(h: Harness, cron: str, key: str, *, due: datetime | None = None) -> str:
    """A schedule as a version before 0cbce10 stored it: its API took an empty list item or a bare
    step (read as "*"), which the API refuses now."""
    from run_engine.ids import new_id

    sched = await h.engine.resources.repo.schedules.upsert(
        id=new_id("sched"), env_id=h.env.env_id, task_id="hello", cron=cron, timezone="UTC", external_id=None,
        deduplication_key=key, next_run_at=due or ts(h) - timedelta(seconds=30), type="IMPERATIVE")
    assert sched is not None
    return sched.id


async def test_a_schedule_stored_with_a_cron_refused_now_keeps_firing_as_before(
        h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    """A cron the version before accepted ("/5" as "*/5", "0 , * * *" hourly) was taken at its next
    tick as one whose next tick cannot be worked out: the schedule was stopped for good, silently,
    by old and new processes alike. It fires as the version before fired it, with a warning."""
    caplog.set_level(logging.WARNING, logger="systems.schedules")
    schedules = h.engine.systems.schedules
    five = await legacy_schedule(h, "/5 * * * *", "legacy-five")
    hourly = await legacy_schedule(h, "0 , * * *", "legacy-hourly")
    await schedules.fire_due(jitter_s=0)
    for sched_id, minutes in ((five, 5), (hourly, 60)):
        assert len(await runs_of(h, sched_id)) == 1
        after = await h.engine.resources.repo.schedules.get(sched_id)
        assert after is not None and after.active and after.next_run_at is not None
        assert after.next_run_at > ts(h) and after.next_run_at.minute % minutes == 0
        assert after.next_run_at - ts(h) <= timedelta(minutes=minutes)
    row = await h.engine.resources.repo.schedules.get(five)
    assert row is not None and row.next_run_at is not None
    h.clock.advance((row.next_run_at - ts(h)).total_seconds())
    await schedules.fire_due(jitter_s=0)
    assert len(await runs_of(h, five)) == 2
    # deactivated and activated again: from now, as before
    await schedules.set_active(h.env.env_id, five, False)
    on = await schedules.set_active(h.env.env_id, five, True)
    assert on.active and on.next_run_at is not None and on.next_run_at.minute % 5 == 0
    warned = [r.getMessage() for r in caplog.records if "read as the versions before" in r.getMessage()]
    assert len([m for m in warned if five in m]) == 1 and len([m for m in warned if hourly in m]) == 1, warned


async def test_a_deployment_declaring_a_cron_refused_now_still_registers_and_its_schedule_fires(h: Harness) -> None:
    """Unchanged code declaring "0 0 , * *" (every day, to the version before) could not register:
    ValidationError deployment.tasks.1.cron ',' has an empty list item."""
    await h.deploy({"id": "hello"}, {"id": "nightly", "cron": "0 0 , * *"}, version="2")
    (decl,) = [r for r in await h.engine.resources.repo.schedules.page(h.env.env_id, 10, None)
               if r.type == "DECLARATIVE"]
    assert decl.cron == "0 0 , * *" and decl.next_run_at is not None
    assert decl.next_run_at - ts(h) <= timedelta(days=1) and (decl.next_run_at.hour, decl.next_run_at.minute) == (0, 0)
    h.clock.advance((decl.next_run_at - ts(h)).total_seconds())
    await h.engine.systems.schedules.fire_due(jitter_s=0)
    (run,) = await runs_of(h, decl.id)
    after = await h.engine.resources.repo.schedules.get(decl.id)
    assert after is not None and after.active and after.next_run_at == decl.next_run_at + timedelta(days=1)
    await h.deploy({"id": "hello"}, {"id": "nightly", "cron": "/5 * * * *"}, version="3")  # and changed so
    again = await h.engine.resources.repo.schedules.get(decl.id)
    assert again is not None and again.cron == "/5 * * * *" and again.next_run_at is not None
    assert again.next_run_at.minute % 5 == 0 and again.next_run_at - ts(h) <= timedelta(minutes=5)


async def test_the_api_refuses_a_new_cron_with_an_empty_item_but_not_the_one_a_schedule_has(  # type: ignore[no-untyped-def]
        h: Harness, api) -> None:
    """The SDK's create with a deduplication key (an app's start) or a PUT sending the cron the
    schedule has already writes no new cron: it keeps working for a schedule stored before."""
    sched_id = await legacy_schedule(h, "/5 * * * *", "boot", due=ts(h) + timedelta(minutes=5))
    same = await api.post("/api/v1/schedules", json={"task": "hello", "cron": "/5 * * * *",
                                                     "deduplicationKey": "boot", "externalId": "x"})
    assert same.status_code == 200 and same.json()["id"] == sched_id and same.json()["externalId"] == "x", same.text
    put = await api.put(f"/api/v1/schedules/{sched_id}", json={"task": "hello", "cron": "/5 * * * *",
                                                                "timezone": "Europe/Paris"})
    assert put.status_code == 200 and put.json()["timezone"] == "Europe/Paris", put.text
    for body in ({"task": "hello", "cron": "0 , * * *", "deduplicationKey": "boot"},  # a new cron
                 {"task": "hello", "cron": "/5 * * * *", "deduplicationKey": "other"},  # a new schedule
                 {"task": "hello", "cron": "/5 * * * *"}):
        refused = await api.post("/api/v1/schedules", json=body)
        assert refused.status_code == 400 and "cron" in refused.text, (body, refused.text)
    put = await api.put(f"/api/v1/schedules/{sched_id}", json={"task": "hello", "cron": "/10 * * * *"})
    assert put.status_code == 400 and "a step needs a start" in put.text, put.text
    row = await h.engine.resources.repo.schedules.get(sched_id)
    assert row is not None and row.cron == "/5 * * * *" and row.active


async def test_the_ticks_a_process_fires_skips_or_stops_are_counted(make_engine) -> None:  # type: ignore[no-untyped-def]
    """A refused tick was only a warning in the log: an operator could not see an environment's
    schedules skipping every tick (its queue full) on a dashboard."""
    from run_engine import metrics

    def ticks(outcome: str) -> float:
        return metrics.REGISTRY.get_sample_value("run_engine_schedule_ticks_total", {"outcome": outcome}) or 0.0

    h: Harness = await make_engine(max_queue_length=1)
    await h.deploy({"id": "hello"})
    uninstall = metrics.EngineMetrics().install(h.engine.events)
    try:
        before = {o: ticks(o) for o in ("fired", "skipped")}
        sched = await h.engine.systems.schedules.upsert(h.env.env_id, task="hello", cron="* * * * *")
        h.clock.advance((sched.next_run_at - ts(h)).total_seconds())
        assert await h.engine.systems.schedules.fire_due(jitter_s=0) == 1  # the queue is full now
        h.clock.advance(60)
        assert await h.engine.systems.schedules.fire_due(jitter_s=0) == 0
        assert {o: ticks(o) - before[o] for o in before} == {"fired": 1, "skipped": 1}
    finally:
        uninstall()


async def test_a_tick_two_processes_skip_is_counted_once(make_engine, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Both read the tick due before either moved the schedule past it: only the one whose move
    took counts it (each counted it: a dashboard showed twice the ticks skipped)."""
    from run_engine import metrics

    def skipped() -> float:
        return metrics.REGISTRY.get_sample_value("run_engine_schedule_ticks_total", {"outcome": "skipped"}) or 0.0

    h: Harness = await make_engine(max_queue_length=1)
    await h.deploy({"id": "hello"})
    await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))  # the queue is full
    uninstall = metrics.EngineMetrics().install(h.engine.events)
    try:
        sched = await h.engine.systems.schedules.upsert(h.env.env_id, task="hello", cron="* * * * *")
        tick = sched.next_run_at
        assert tick is not None
        h.clock.advance((tick - ts(h)).total_seconds())
        before = skipped()
        schedules = h.engine.systems.schedules
        now = await schedules._now()
        assert await schedules._fire_now(sched.id, tick, now) == 0  # refused: skipped, moved on
        stale = sched  # what the other process read before that move

        async def as_read_before(schedule_id: str, env_id: str | None = None) -> object:
            return stale

        monkeypatch.setattr(h.engine.resources.repo.schedules, "get", as_read_before)
        assert await schedules._fire_now(sched.id, tick, now) == 0  # refused too; its move finds it moved
        assert skipped() - before == 1
    finally:
        uninstall()


async def test_a_skipped_tick_is_not_the_schedules_last_run(make_engine) -> None:  # type: ignore[no-untyped-def]
    """A tick refused (the queue full) made no run, but became the schedule's ``lastRun`` and the
    next run's ``lastTimestamp``: a task reading it as the time it last ran missed that window. It
    stays the last tick that made a run (Trigger.dev's skip carries it forward too)."""
    h: Harness = await make_engine(max_queue_length=1)
    await h.deploy({"id": "hello"})
    schedules = h.engine.systems.schedules
    sched = await schedules.upsert(h.env.env_id, task="hello", cron="* * * * *")
    first = sched.next_run_at
    h.clock.advance((first - ts(h)).total_seconds())
    assert await schedules.fire_due(jitter_s=0) == 1  # the queue is full now
    (made,) = await runs_of(h, sched.id)
    h.clock.advance(60)
    assert await schedules.fire_due(jitter_s=0) == 0  # refused: skipped
    after = await h.engine.resources.repo.schedules.get(sched.id)
    assert after is not None and after.next_run_at == first + timedelta(minutes=2)
    assert after.last_run_at == first, f"lastRun {after.last_run_at}: a tick that made no run"
    await h.engine.cancel(made.id)  # room in the queue again
    h.clock.advance(60)
    assert await schedules.fire_due(jitter_s=0) == 1
    third = next(r for r in await runs_of(h, sched.id) if r.id != made.id)
    assert datetime.fromisoformat(third.payload["timestamp"]) == first + timedelta(minutes=2)
    assert datetime.fromisoformat(third.payload["lastTimestamp"]) == first


async def test_a_deactivated_schedule_created_again_with_a_new_cron_shows_no_next_tick(h: Harness) -> None:
    """A create with the deduplication key of a deactivated schedule (the SDK's create at every
    start of an app) and another cron gave it a next tick it never fires (nextRun shown, the
    schedule inactive), where a PUT leaves it none; activating it works the tick out from then."""
    schedules = h.engine.systems.schedules
    sched = await schedules.upsert(h.env.env_id, task="hello", cron="0 * * * *", deduplication_key="off")
    await schedules.set_active(h.env.env_id, sched.id, False)
    again = await schedules.upsert(h.env.env_id, task="hello", cron="*/5 * * * *", deduplication_key="off")
    assert again.id == sched.id and again.cron == "*/5 * * * *"
    assert again.active is False and again.next_run_at is None, again.next_run_at
    on = await schedules.set_active(h.env.env_id, sched.id, True)
    assert on.next_run_at is not None and on.next_run_at > ts(h) and on.next_run_at.minute % 5 == 0


@pytest.mark.parametrize("cron", ["0 0 30 2 *", "0 0 31 4 *", "0 0 31 2,4,6,9,11 ?", "* * 30,31 feb *",
                                  "0 0 0 31 11 *"])
async def test_a_cron_no_day_can_match_is_refused_without_the_search_of_5_years(  # type: ignore[no-untyped-def]
        h: Harness, api, monkeypatch: pytest.MonkeyPatch, cron: str) -> None:
    """A cron that never fires was refused only once the search had walked 5 years of days (8 to
    30 ms of CPU a request, any tenant under its rate limit); one whose day-of-month is past the
    longest of its months is refused at once now, with the same 400, over the API and a worker's
    declared cron alike. The search is the judge of the rest (next test)."""
    from run_engine.cron import Cron

    def searched(*args: object) -> None:
        raise AssertionError("the 5-year search ran")

    monkeypatch.setattr(Cron, "_first_match", searched)
    refused = await api.post("/api/v1/schedules", json={"task": "hello", "cron": cron})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"] == {"code": "invalid_input", "message": f"cron: {cron!r} never fires"}
    async with api_client(h, h.env.env_worker_group_token) as worker:
        connected = await worker.post("/engine/v1/worker-actions/connect", json={
            "workerInstanceName": "w-1", "deployment": {"tasks": [{"id": "hello", "cron": cron}]}})
    assert connected.status_code == 400, connected.text
    assert connected.json()["error"]["message"] == f"deployment.tasks.0.cron: {cron!r} never fires"


async def test_crons_of_the_last_days_of_months_that_have_them_are_still_taken(  # type: ignore[no-untyped-def]
        h: Harness, api) -> None:
    """What the refusal without a search keeps: February 29th (leap years), a 31st of some month
    allowed, a day-of-week given with the day-of-month (either matches)."""
    for cron, months, day in (("0 0 29 2 *", {2}, 29), ("0 0 31 2,3 *", {3}, 31), ("0 0 30 1-2 *", {1}, 30),
                              ("0 0 31 */2 *", {1, 3, 5, 7, 9, 11}, 31), ("0 0 31 2 mon", {2}, None)):
        made = await api.post("/api/v1/schedules", json={"task": "hello", "cron": cron})
        assert made.status_code == 200, (cron, made.text)
        tick = datetime.fromisoformat(made.json()["nextRun"].replace("Z", "+00:00"))
        assert tick.month in months and (tick.day == day if day else tick.isoweekday() == 1), (cron, tick)
