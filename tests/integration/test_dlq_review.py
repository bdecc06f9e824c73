"""From a review of the dead-letter queue, redrive, bulk actions and cancellation: each test
shows a bug of the code before it (a wrong answer, a run lost or a tenant's runs affected)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from run_engine.engine import TriggerRequest

from .conftest import Harness


async def dead_letter(h: Harness, count: int) -> list[str]:
    """``count`` runs of ``hello`` in the DLQ (each dequeued once and never started), in DLQ order."""
    runs = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello")
                                        for _ in range(count)])
    assert len(await h.engine.dequeue(h.env.worker_group_id, count)) == count
    await h.advance(61)
    return [e.run_id for e in await h.engine.resources.queue.list_dlq(h.env.env_id)
            if e.run_id in {r.id for r in runs}]


async def delete_rows(h: Harness, run_ids: list[str]) -> None:
    """Rows gone while their DLQ entries stay (a retention of an older version, or a crash)."""
    async with h.engine.resources.repo.pool.connection() as conn:
        await conn.execute("DELETE FROM task_run WHERE id = ANY(%s)", (run_ids,))


async def test_a_dlq_page_whose_first_entries_are_of_deleted_runs_does_not_say_the_dlq_ended(
        make_engine) -> None:  # type: ignore[no-untyped-def]
    """A page measured one more run than it could take; when those were all of deleted runs
    (dropped on the way), the next entry was taken for one past the page's end and the page
    ended with no run and no cursor: the DLQ read as empty with runs in it."""
    h: Harness = await make_engine(max_deliveries=1)
    await h.deploy({"id": "hello"})
    ids = await dead_letter(h, 4)
    await delete_rows(h, ids[:2])
    dead, after = await h.engine.list_dead(h.env.env_id, 1)
    seen = [d.run.id for d in dead]
    while after is not None:
        dead, after = await h.engine.list_dead(h.env.env_id, 1, after)
        seen += [d.run.id for d in dead]
    assert seen == ids[2:]


def cancel_failing_at(h: Harness, monkeypatch, at_run: str, why: str) -> None:  # type: ignore[no-untyped-def]
    """Every cancel of ``at_run`` fails with ConnectionError(``why``) until ``monkeypatch`` is undone."""
    cancel = h.engine.systems.cancel
    real = cancel._cancel_one

    async def fails_there(run_id: str):  # type: ignore[no-untyped-def]
        if run_id == at_run:
            raise ConnectionError(why)
        return await real(run_id)

    monkeypatch.setattr(cancel, "_cancel_one", fails_there)


async def cancel_dying_at(h: Harness, monkeypatch, at_run: str,  # type: ignore[no-untyped-def]
                          act: Callable[[], Awaitable[object]], caught: type[Exception] = ConnectionError) -> None:
    """``act`` (a cancel, a bulk cancel's page) with the process dying as its cancel comes to
    ``at_run``: the runs before are cancelled, that one and those after are not."""
    cancel_failing_at(h, monkeypatch, at_run, "the process died here")
    try:
        await act()
    except caught:
        pass
    monkeypatch.undo()


async def test_a_cancel_of_a_deep_chain_of_waiting_runs_is_answered_and_reaches_its_end(h: Harness) -> None:
    """A cancel went down the runs each run waits on by recursion: a chain of a thousand (each run
    triggered with the one before as its parent, resumeParentOnCompletion: what the public API
    takes) failed the request with a RecursionError (500) a thousand deep, the runs below left as
    they were."""
    from run_engine.ids import new_id

    from .conftest import api_client

    ids = [new_id("run") for _ in range(1100)]
    await h.engine.trigger_many([
        TriggerRequest(env_id=h.env.env_id, task_id="hello", run_id=run_id, parent_run_id=parent,
                       root_run_id=ids[0] if parent else None, depth=depth,
                       resume_parent_on_completion=parent is not None)
        for depth, (run_id, parent) in enumerate(zip(ids, [None, *ids[:-1]], strict=True))])
    async with api_client(h) as client:
        r = await client.post(f"/api/v2/runs/{ids[0]}/cancel")
    assert r.status_code == 200, r.text
    await h.advance(0)  # the runs past the request's page: its job's, due at once
    runs = await h.engine.resources.repo.runs.runs_by_ids(h.env.env_id, ids)
    assert {runs[i].status for i in ids} == {"CANCELED"}


async def test_a_cancel_tried_again_reaches_the_runs_below_a_run_it_cancelled_before_it_stopped(
        h: Harness, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A cancel that stopped part way down (its process died, a lock was busy) after it had
    cancelled a waiting run left that run's own children running; the cancel tried again went
    only into children not finished, so never past the run it had cancelled: they ran on."""
    from .test_waitpoints import req, started_run

    root, s = await started_run(h)
    (child_id,), out = await h.engine.trigger_and_wait(root.id, s.snapshot.id, 0, [req(h)])
    await h.engine.suspend(root.id, out.snapshot.id)
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)
    cs = await h.engine.start_attempt(child_id, d.snapshot.id)
    (grandchild_id,), out = await h.engine.trigger_and_wait(child_id, cs.snapshot.id, 0, [req(h)])
    await h.engine.suspend(child_id, out.snapshot.id)
    await cancel_dying_at(h, monkeypatch, grandchild_id, lambda: h.engine.cancel(root.id))
    assert (await h.engine.get_run(child_id)).status == "CANCELED"  # type: ignore[union-attr]
    assert (await h.engine.get_run(grandchild_id)).status == "QUEUED"  # type: ignore[union-attr]
    await h.engine.cancel(root.id)  # the caller tries again
    assert (await h.engine.get_run(grandchild_id)).status == "CANCELED"  # type: ignore[union-attr]
    assert await h.engine.dequeue(h.env.worker_group_id, 5) == []


async def test_a_bulk_cancel_page_tried_again_reaches_the_runs_below_a_run_its_first_try_cancelled(
        h: Harness, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A bulk cancel's page whose cascade stopped part way (a busy lock, a process that died)
    is tried again; the try again left out the runs of the page cancelled since the action was
    made (counted as the earlier try's) and so never went on below them: their children's
    children ran on."""
    from run_engine.engine import RunFilter

    from .test_waitpoints import started_run

    root, s = await started_run(h)
    (child_id,), out = await h.engine.trigger_and_wait(
        root.id, s.snapshot.id, 0, [TriggerRequest(env_id=h.env.env_id, task_id="hello", tags=("nested",))])
    await h.engine.suspend(root.id, out.snapshot.id)
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)
    cs = await h.engine.start_attempt(child_id, d.snapshot.id)
    (grandchild_id,), out = await h.engine.trigger_and_wait(
        child_id, cs.snapshot.id, 0, [TriggerRequest(env_id=h.env.env_id, task_id="hello")])
    await h.engine.suspend(child_id, out.snapshot.id)
    async with h.engine.resources.repo.pool.connection() as conn:  # the root alone is named by the filter
        await conn.execute("UPDATE task_run SET tags = '{nested}' WHERE id = %s", (root.id,))
        await conn.execute("UPDATE task_run SET tags = '{}' WHERE id = %s", (child_id,))
    action, _ = await h.engine.create_bulk_action(h.env.env_id, "CANCEL", RunFilter(tags=("nested",)))
    bulk = h.engine.systems.bulk_actions
    # the page fails (RuntimeError), to be tried again
    await cancel_dying_at(h, monkeypatch, grandchild_id, lambda: bulk.run_page(action.id), RuntimeError)
    assert (await h.engine.get_run(root.id)).status == "CANCELED"  # type: ignore[union-attr]
    assert (await h.engine.get_run(grandchild_id)).status == "QUEUED"  # type: ignore[union-attr]
    while await bulk.run_page(action.id):
        pass
    done = await h.engine.bulk_action(h.env.env_id, action.id)
    assert (done.status, done.processed, done.succeeded) == ("COMPLETED", 1, 1)  # type: ignore[union-attr]
    assert (await h.engine.get_run(grandchild_id)).status == "CANCELED"  # type: ignore[union-attr]


async def test_a_cancel_that_stopped_part_way_is_taken_up_again_by_the_engine(
        h: Harness, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A cancel whose process died (or whose child's lock was busy) after it had cancelled the run
    and before it reached the children the run waits on left them running for good, unless the
    caller happened to cancel again: the dashboard's button, a script that does not retry, or a
    process that died with nobody to answer. The engine takes the cancel up again itself."""
    from systems.cancel import CASCADE_GRACE_S

    from .test_waitpoints import req, started_run

    root, s = await started_run(h)
    (child_id,), out = await h.engine.trigger_and_wait(root.id, s.snapshot.id, 0, [req(h)])
    await h.engine.suspend(root.id, out.snapshot.id)
    await cancel_dying_at(h, monkeypatch, child_id, lambda: h.engine.cancel(root.id))
    assert (await h.engine.get_run(root.id)).status == "CANCELED"  # type: ignore[union-attr]
    assert (await h.engine.get_run(child_id)).status == "QUEUED"  # type: ignore[union-attr]
    await h.engine.systems.reconciler.reconcile(grace_s=-1)  # nobody cancels again: the engine's own repairs
    await h.advance(CASCADE_GRACE_S + 1)
    assert (await h.engine.get_run(child_id)).status == "CANCELED"  # type: ignore[union-attr]
    assert await h.engine.dequeue(h.env.worker_group_id, 5) == []


async def test_a_cancel_that_reached_its_end_leaves_no_job_behind(h: Harness) -> None:
    """The job that takes a cancel up again is armed only for a run with children it waits on,
    and goes once the cancel reached the end of them."""
    from systems import engine_jobs

    from .test_waitpoints import req, started_run

    root, s = await started_run(h)
    (child_id,), out = await h.engine.trigger_and_wait(root.id, s.snapshot.id, 0, [req(h)])
    await h.engine.suspend(root.id, out.snapshot.id)
    (alone,) = await h.engine.trigger_many([req(h)])
    await h.engine.cancel(root.id)
    await h.engine.cancel(alone.id)
    assert (await h.engine.get_run(child_id)).status == "CANCELED"  # type: ignore[union-attr]
    ids = [engine_jobs.cancel_cascade_id(root.id), engine_jobs.cancel_cascade_id(alone.id)]
    assert await h.engine.resources.jobs.missing(ids) == ids


async def test_a_run_dead_lettered_on_its_way_to_be_restored_is_restored_when_redriven(make_engine) -> None:  # type: ignore[no-untyped-def]
    """A run whose waits completed goes back to its queue to be restored from its checkpoint
    (QUEUED_EXECUTING: the same attempt, by journal replay). Dead-lettered on that way (its
    restores never started), its redrive made it QUEUED without the checkpoint: the next start
    was a new attempt (2 of a run in its first), as if the first had failed, which a task on its
    last attempt ran past its max attempts."""
    from .test_waitpoints import started_run

    h: Harness = await make_engine(max_deliveries=1)
    await h.deploy({"id": "hello"})
    run, s = await started_run(h)
    token, _ = await h.engine.waitpoints.create_token(h.env.env_id, timeout_s=3600)
    out = await h.engine.block(run.id, s.snapshot.id, sequence=0, kind="token", key=token.id,
                               waitpoint_ids=[token.id])
    checkpoint = (await h.engine.suspend(run.id, out.snapshot.id)).checkpoint_id
    assert await h.engine.waitpoints.complete(token.id, {"approved": True})
    assert len(await h.engine.dequeue(h.env.worker_group_id, 10)) == 1  # handed out, never started
    await h.advance(61)
    assert (await h.engine.get_run(run.id)).status == "SYSTEM_FAILURE"  # type: ignore[union-attr]
    await h.engine.redrive(h.env.env_id, run.id)
    assert (await h.engine.latest_snapshot(run.id)).engine_status == "QUEUED_EXECUTING"
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 10)
    assert d.snapshot.checkpoint_id == checkpoint
    resumed = await h.engine.start_attempt(run.id, d.snapshot.id)
    assert resumed.attempt_number == 1  # the same attempt, restored
    assert (await h.engine.complete_attempt(run.id, resumed.snapshot.id, ok=True, output=1)).status == "COMPLETED"


async def test_the_job_of_a_cancel_whose_run_was_deleted_since_ends(h: Harness, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The job that takes a cancel up again finds nothing to cancel when the run is gone
    (retention): it ends, rather than failing and being tried again for its every attempt."""
    from systems import engine_jobs
    from systems.cancel import CASCADE_GRACE_S

    from .test_waitpoints import req, started_run

    root, s = await started_run(h)
    (child_id,), out = await h.engine.trigger_and_wait(root.id, s.snapshot.id, 0, [req(h)])
    await h.engine.suspend(root.id, out.snapshot.id)
    cancel = h.engine.systems.cancel

    async def dies(run_id: str):  # type: ignore[no-untyped-def]
        raise ConnectionError("the process died here")

    monkeypatch.setattr(cancel, "_cancel_one", dies)
    try:
        await h.engine.cancel(root.id)
    except ConnectionError:
        pass
    monkeypatch.undo()
    await delete_rows(h, [child_id, root.id])
    await h.advance(CASCADE_GRACE_S + 1)
    job = engine_jobs.cancel_cascade_id(root.id)
    assert await h.engine.resources.jobs.missing([job]) == [job]


async def test_a_cancel_of_many_children_cancels_a_page_and_hands_the_rest_to_its_job(
        h: Harness, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A cancel cancelled every run below its run in the request, one lock and transaction each:
    a tree of 100,000 children held it for minutes. It now cancels CASCADE_PAGE of them and hands
    the rest to its job, due at once, which goes on a page at a time until none is left."""
    import systems.cancel
    from systems import engine_jobs

    from .test_waitpoints import req, started_run

    monkeypatch.setattr(systems.cancel, "CASCADE_PAGE", 2)
    root, s = await started_run(h)
    ids, out = await h.engine.trigger_and_wait(root.id, s.snapshot.id, 0, [req(h) for _ in range(7)], batch=True)
    await h.engine.suspend(root.id, out.snapshot.id)
    assert await h.engine.cancel(root.id) == "CANCELED"

    async def statuses() -> list[str]:
        return [(await h.engine.get_run(i)).status for i in ids]  # type: ignore[union-attr]

    assert sorted(await statuses()) == ["CANCELED"] * 2 + ["QUEUED"] * 5  # a page, and no more
    assert await h.advance(0) >= 3  # the job, due at once: a page each time, armed again until done
    assert await statuses() == ["CANCELED"] * 7
    assert await h.engine.dequeue(h.env.worker_group_id, 10) == []
    job = engine_jobs.cancel_cascade_id(root.id)
    assert await h.engine.resources.jobs.missing([job]) == [job]  # nothing left armed


async def test_a_cancel_whose_job_failed_every_attempt_is_taken_up_again_by_the_reconciler(
        h: Harness, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A cancel that stopped part way leaves the rest to its job, `cancel.<run>`. When that job
    failed every attempt (a PostgreSQL outage longer than its retries) it lay in the job DLQ, and
    nothing armed it again: the reconciler's re-arm knew delays, TTLs, waitpoints and bulk actions,
    not cancels, and the children of a cancelled run were left running or queued for good."""
    from systems import engine_jobs
    from systems.cancel import CASCADE_GRACE_S

    from .test_waitpoints import req, started_run

    root, s = await started_run(h)
    (child_id,), out = await h.engine.trigger_and_wait(root.id, s.snapshot.id, 0, [req(h)])
    await h.engine.suspend(root.id, out.snapshot.id)
    cancel_failing_at(h, monkeypatch, child_id, "PostgreSQL is away")
    monkeypatch.setattr(h.engine.resources.jobs, "max_attempts", 1)  # the outage outlasts the job's retries
    try:
        await h.engine.cancel(root.id)
    except ConnectionError:
        pass
    assert await h.advance(CASCADE_GRACE_S + 1) == 1  # the job, which fails its every attempt
    job = engine_jobs.cancel_cascade_id(root.id)
    assert job in [dead.id for dead, _ in await h.engine.resources.jobs.dlq(10_000)]
    monkeypatch.undo()  # PostgreSQL is back
    assert (await h.engine.get_run(child_id)).status == "QUEUED"  # type: ignore[union-attr]

    await h.engine.systems.reconciler.rearm_jobs(grace_s=-1)  # the leader's re-arm, every 60 s
    await h.advance(0)
    assert (await h.engine.get_run(child_id)).status == "CANCELED"  # type: ignore[union-attr]
    assert await h.engine.dequeue(h.env.worker_group_id, 5) == []
    assert await h.engine.resources.jobs.missing([job]) == [job]
    assert job not in [dead.id for dead, _ in await h.engine.resources.jobs.dlq(10_000)]
    await h.engine.systems.reconciler.rearm_jobs(grace_s=-1)  # the cascade is through: not armed again
    assert await h.engine.resources.jobs.missing([job]) == [job]
