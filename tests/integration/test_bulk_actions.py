"""Bulk actions through the engine: a page done twice (two workers, or a process that died after
acting and before recording the page) replays nothing twice and counts once; the action covers
only the runs that existed when it was made; a cancel skips finished runs."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from run_engine.engine import RunFilter, TriggerRequest
from run_engine.tenancy import ensure_environment
from systems.bulk_actions import PAGE

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


async def _runs(h: Any, n: int, tag: str) -> list[str]:
    made = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="t", payload={"i": i},
                                                       tags=(tag,)) for i in range(n)])
    return [m.id for m in made]


async def test_a_page_done_twice_replays_nothing_twice(h: Any) -> None:
    await h.deploy({"id": "t"})
    originals = await _runs(h, PAGE + 30, "x")
    action, cached = await h.engine.create_bulk_action(h.env.env_id, "REPLAY", RunFilter(tags=("x",)), "k")
    assert not cached and action.status == "PENDING"
    again, cached = await h.engine.create_bulk_action(h.env.env_id, "REPLAY", RunFilter(tags=("x",)), "k")
    assert cached and again.id == action.id
    bulk = h.engine.systems.bulk_actions
    # two workers on the same page at once (its job taken again after its lease ran out): both
    # act, one records the page and goes on; the other asks for nothing more (its job again would
    # replace the next page's while that runs: a third worker on it, and every later page twice)
    assert sorted(await asyncio.gather(bulk.run_page(action.id), bulk.run_page(action.id))) == [False, True]
    while await bulk.run_page(action.id):
        pass
    done = await h.engine.bulk_action(h.env.env_id, action.id)
    assert done is not None and done.status == "COMPLETED" and done.completed_at is not None
    assert done.processed == PAGE + 30 and done.succeeded == PAGE + 30
    tagged = await h.engine.list_runs(h.env.env_id, tags=["x"], limit=1000)
    replays = [r for r in tagged if r.id not in originals]
    assert len(replays) == PAGE + 30  # each original replayed exactly once, and the replays not replayed
    assert {r.idempotency_key for r in replays} == {f"{action.id}:{o}" for o in originals}
    assert await bulk.run_page(action.id) is False  # finished: nothing more


async def test_cancel_skips_finished_runs_and_other_runs(h: Any) -> None:
    await h.deploy({"id": "t"})
    doomed = await _runs(h, 5, "doomed")
    kept = await _runs(h, 3, "kept")
    await h.engine.cancel(doomed[0])  # finished already: not counted again
    action, _ = await h.engine.create_bulk_action(h.env.env_id, "CANCEL", RunFilter(tags=("doomed",)))
    while await h.engine.systems.bulk_actions.run_page(action.id):
        pass
    done = await h.engine.bulk_action(h.env.env_id, action.id)
    assert done is not None and (done.processed, done.succeeded) == (5, 4)
    assert {(await h.engine.get_run(r)).status for r in doomed} == {"CANCELED"}
    assert "CANCELED" not in {(await h.engine.get_run(r)).status for r in kept}
    assert await h.engine.bulk_action("env_someone_else", action.id) is None


async def test_an_action_whose_job_was_lost_is_rearmed_and_finishes(h: Any) -> None:
    """A crash between the action's row and its job (or Redis losing the job): the reconciler's
    re-arm finds the PENDING action and its job runs it to the end."""
    from systems import engine_jobs

    await h.deploy({"id": "t"})
    await _runs(h, 3, "lost")
    action, _ = await h.engine.create_bulk_action(h.env.env_id, "CANCEL", RunFilter(tags=("lost",)))
    await h.engine.resources.change_jobs(cancel=[engine_jobs.bulk_action_id(action.id)])  # the job is gone
    assert await h.engine.run_due_jobs() == 0
    assert (await h.engine.bulk_action(h.env.env_id, action.id)).status == "PENDING"
    await h.engine.systems.reconciler.rearm_jobs(grace_s=-1, full=True)
    for _ in range(10):
        await h.engine.run_due_jobs()
        done = await h.engine.bulk_action(h.env.env_id, action.id)
        if done.status == "COMPLETED":
            break
    assert (done.status, done.processed, done.succeeded) == ("COMPLETED", 3, 3)


@pytest.mark.parametrize("kind", ["CANCEL", "REPLAY"])
async def test_a_try_that_died_before_recording_its_page_counts_once_on_the_next(
        h: Any, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker acts on the whole page, then dies before the page is recorded: the next try
    finds the page's runs already cancelled (or replayed) by this action and counts them."""
    await h.deploy({"id": "t"})
    await _runs(h, PAGE + 7, "died")
    action, _ = await h.engine.create_bulk_action(h.env.env_id, kind, RunFilter(tags=("died",)))
    bulk = h.engine.systems.bulk_actions
    real = bulk.r.repo.bulk_actions.advance

    async def dies(*args: Any, **kwargs: Any) -> bool:
        monkeypatch.setattr(bulk.r.repo.bulk_actions, "advance", real)
        raise ConnectionError("the process died here")

    monkeypatch.setattr(bulk.r.repo.bulk_actions, "advance", dies)
    with pytest.raises(ConnectionError):
        await bulk.run_page(action.id)
    while await bulk.run_page(action.id):
        pass
    done = await h.engine.bulk_action(h.env.env_id, action.id)
    assert (done.status, done.processed, done.succeeded) == ("COMPLETED", PAGE + 7, PAGE + 7)
    tagged = await h.engine.list_runs(h.env.env_id, tags=["died"], limit=1000)
    if kind == "CANCEL":
        assert {r.status for r in tagged} == {"CANCELED"}
    else:
        assert len(tagged) == 2 * (PAGE + 7)  # each run replayed once


async def test_two_workers_on_one_cancel_page_count_each_run_once(h: Any) -> None:
    await h.deploy({"id": "t"})
    await _runs(h, PAGE + 3, "twice")
    action, _ = await h.engine.create_bulk_action(h.env.env_id, "CANCEL", RunFilter(tags=("twice",)))
    bulk = h.engine.systems.bulk_actions
    assert sorted(await asyncio.gather(bulk.run_page(action.id), bulk.run_page(action.id))) == [False, True]
    while await bulk.run_page(action.id):
        pass
    done = await h.engine.bulk_action(h.env.env_id, action.id)
    assert (done.processed, done.succeeded) == (PAGE + 3, PAGE + 3)


async def test_a_repeated_request_does_not_hand_the_page_to_a_second_worker(h: Any) -> None:
    """The same idempotency key again while a worker holds the action's job leaves the job alone
    (making it due again would start the same page twice at once); a job that is gone is re-armed."""
    from systems import engine_jobs

    await h.deploy({"id": "t"})
    await _runs(h, 3, "again")
    action, _ = await h.engine.create_bulk_action(h.env.env_id, "CANCEL", RunFilter(tags=("again",)), "same")
    job_id = engine_jobs.bulk_action_id(action.id)
    jobs = h.engine.resources.jobs
    assert job_id in {j.id for j in await jobs.claim(100)}  # a worker holds it now
    _, cached = await h.engine.create_bulk_action(h.env.env_id, "CANCEL", RunFilter(tags=("again",)), "same")
    assert cached and job_id not in {j.id for j in await jobs.claim(100)}
    await h.engine.resources.change_jobs(cancel=[job_id])  # lost
    await h.engine.create_bulk_action(h.env.env_id, "CANCEL", RunFilter(tags=("again",)), "same")
    assert await jobs.missing([job_id]) == []


async def test_a_run_that_cannot_be_cancelled_now_fails_the_page_which_is_tried_again(
        h: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy lock (or PostgreSQL, Redis away) is not a reason to leave a run behind for good: the
    page fails, its job is tried again, and the count comes out right; a run the engine refuses
    (gone) is skipped."""
    from run_engine.errors import LockTimeoutError, NotFoundError

    await h.deploy({"id": "t"})
    runs = await _runs(h, 6, "busy")
    action, _ = await h.engine.create_bulk_action(h.env.env_id, "CANCEL", RunFilter(tags=("busy",)))
    bulk = h.engine.systems.bulk_actions
    real = bulk.cancel.cancel
    busy = {runs[1]}

    async def cancel(run_id: str) -> Any:
        if run_id in busy:
            busy.discard(run_id)
            raise LockTimeoutError((run_id,), 15.0, 10)
        if run_id == runs[4]:
            raise NotFoundError("run", run_id)  # deleted meanwhile: refused for good
        return await real(run_id)

    monkeypatch.setattr(bulk.cancel, "cancel", cancel)
    with pytest.raises(RuntimeError, match="1 runs could not be done now"):
        await bulk.run_page(action.id)
    assert (await h.engine.bulk_action(h.env.env_id, action.id)).processed == 0  # not recorded
    assert await bulk.run_page(action.id) is False
    done = await h.engine.bulk_action(h.env.env_id, action.id)
    assert (done.status, done.processed, done.succeeded) == ("COMPLETED", 6, 5)
    assert [(await h.engine.get_run(r)).status == "CANCELED" for r in runs] == [True] * 4 + [False, True]


async def test_one_environment_has_at_most_ten_actions_under_way(h: Any) -> None:
    from run_engine.errors import TooManyError
    from systems.bulk_actions import MAX_PENDING

    await h.deploy({"id": "t"})
    made = [await h.engine.create_bulk_action(h.env.env_id, "CANCEL", RunFilter(tags=("none",)), f"k{i}")
            for i in range(MAX_PENDING)]
    with pytest.raises(TooManyError):
        await h.engine.create_bulk_action(h.env.env_id, "CANCEL", RunFilter(tags=("none",)))
    again, cached = await h.engine.create_bulk_action(h.env.env_id, "CANCEL", RunFilter(tags=("none",)), "k3")
    assert cached and again.id == made[3][0].id  # the same request still answers
    other = await ensure_environment(h.engine.resources.repo, secret="test-secret", org=h.env.env_id, project="p",
                                     env="dev")  # another tenant is not held back
    assert (await h.engine.create_bulk_action(other.env_id, "CANCEL", RunFilter(tags=("none",))))[0].id
    await h.engine.systems.bulk_actions.run_page(made[0][0].id)  # one finishes: room for one more
    assert (await h.engine.create_bulk_action(h.env.env_id, "CANCEL", RunFilter(tags=("none",))))[0].id


async def test_the_re_arm_reads_every_action_under_way_a_page_at_a_time(
        h: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from systems import engine_jobs, reconciler

    monkeypatch.setattr(reconciler, "BULK_PAGE", 2)
    await h.deploy({"id": "t"})
    ids = [(await h.engine.create_bulk_action(h.env.env_id, "CANCEL", RunFilter(tags=("x",))))[0].id
           for _ in range(5)]
    jobs = [engine_jobs.bulk_action_id(i) for i in ids]
    await h.engine.resources.change_jobs(cancel=jobs)  # all lost
    assert sorted(await h.engine.resources.jobs.missing(jobs)) == sorted(jobs)
    await h.engine.systems.reconciler.rearm_jobs(grace_s=-1, full=True)
    assert await h.engine.resources.jobs.missing(jobs) == []


async def test_a_run_that_finished_on_its_own_meanwhile_is_not_counted_as_cancelled(
        h: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = [m.id for m in await h.engine.trigger_many([
        TriggerRequest(env_id=h.env.env_id, task_id="hello", payload={"i": i}, tags=("racing",)) for i in range(3)])]
    (taken,) = await h.engine.dequeue(h.env.worker_group_id, 1, start=True)
    action, _ = await h.engine.create_bulk_action(h.env.env_id, "CANCEL", RunFilter(tags=("racing",)))
    bulk = h.engine.systems.bulk_actions
    real = bulk.cancel.cancel

    async def cancel(run_id: str) -> Any:
        if run_id == taken.run.id:  # it completes between the page's read and its cancel
            assert taken.started is not None
            await h.engine.complete_attempt(run_id, taken.started.snapshot.id, ok=True, output=1)
        return await real(run_id)

    monkeypatch.setattr(bulk.cancel, "cancel", cancel)
    assert await bulk.run_page(action.id) is False
    done = await h.engine.bulk_action(h.env.env_id, action.id)
    assert (done.status, done.processed, done.succeeded) == ("COMPLETED", 3, 2)
    assert sorted([(await h.engine.get_run(r)).status for r in runs]) == ["CANCELED", "CANCELED", "COMPLETED"]


async def test_creates_that_race_never_pass_the_limit(h: Any) -> None:
    """Each create counts the environment's actions under way, then inserts; two that count at
    once (a commit held up 50 ms here) must not both pass: they take turns per environment."""
    from run_engine.errors import TooManyError
    from systems.bulk_actions import MAX_PENDING

    await h.deploy({"id": "t"})
    pool = h.engine.resources.repo.bulk_actions.pool
    async with pool.connection() as conn:
        await conn.execute("CREATE FUNCTION slow_insert() RETURNS trigger LANGUAGE plpgsql AS "
                           "$$ BEGIN PERFORM pg_sleep(0.05); RETURN NEW; END $$")
        await conn.execute("CREATE TRIGGER slow_insert BEFORE INSERT ON bulk_action FOR EACH ROW "
                           "EXECUTE FUNCTION slow_insert()")
    try:
        outcomes = await asyncio.gather(*(
            h.engine.create_bulk_action(h.env.env_id, "CANCEL", RunFilter(tags=(f"x{i}",)))
            for i in range(2 * MAX_PENDING + 5)), return_exceptions=True)
    finally:
        async with pool.connection() as conn:
            await conn.execute("DROP TRIGGER slow_insert ON bulk_action")
            await conn.execute("DROP FUNCTION slow_insert()")
    made = [o for o in outcomes if not isinstance(o, BaseException)]
    assert len(made) == MAX_PENDING
    assert all(isinstance(o, TooManyError) for o in outcomes if isinstance(o, BaseException))
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) FROM bulk_action WHERE environment_id = %s AND status = 'PENDING'",
                                 (h.env.env_id,))
        assert (await cur.fetchone())[0] == MAX_PENDING


async def test_the_cancels_of_every_page_in_the_process_share_one_bound(
        h: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages of several actions (of several tenants) at once cancel at most CANCELS_AT_ONCE runs
    together, not that many each: the database pool and the run locks are everyone's."""
    from systems.bulk_actions import CANCELS_AT_ONCE

    await h.deploy({"id": "t"})
    await _runs(h, CANCELS_AT_ONCE, "first")
    await _runs(h, CANCELS_AT_ONCE, "second")
    bulk = h.engine.systems.bulk_actions
    real = bulk.cancel.cancel
    inside = peak = 0

    async def cancel(run_id: str) -> Any:
        nonlocal inside, peak
        inside += 1
        peak = max(peak, inside)
        try:
            await asyncio.sleep(0.01)  # a cancel's round trips
            return await real(run_id)
        finally:
            inside -= 1

    monkeypatch.setattr(bulk.cancel, "cancel", cancel)
    actions = [(await h.engine.create_bulk_action(h.env.env_id, "CANCEL", RunFilter(tags=(tag,))))[0]
               for tag in ("first", "second")]
    await asyncio.gather(*(bulk.run_page(a.id) for a in actions))
    assert peak <= CANCELS_AT_ONCE
    for a in actions:
        done = await h.engine.bulk_action(h.env.env_id, a.id)
        assert (done.status, done.succeeded) == ("COMPLETED", CANCELS_AT_ONCE)
