"""Workers only get runs of tasks their deployment has (issue 11): an old worker gives a new
task's run back, undone and in its place, for another worker; a run of a task that the current
deployment lacks waits as PENDING_VERSION until a deployment with it connects."""

from __future__ import annotations

import pytest

from run_engine.api.models import TaskDecl
from run_engine.engine import TriggerRequest
from run_engine.ids import new_id
from run_engine.tenancy import Environment, ensure_environment

from .conftest import Harness

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


async def test_an_old_worker_gives_a_run_of_a_new_task_back(h: Harness) -> None:
    old = await h.deploy({"id": "a"}, version="old")
    new = await h.deploy({"id": "a"}, {"id": "b"}, version="new")
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="b"))
    assert await h.engine.dequeue(h.env.worker_group_id, 5, deployments=[old]) == []
    assert (await h.engine.get_run(run.id)).status == "QUEUED"  # type: ignore[union-attr]
    assert await h.engine.dequeue(h.env.worker_group_id, 5, deployments=[new]) == []  # not before its turn
    h.clock.advance(0.6)
    (got,) = await h.engine.dequeue(h.env.worker_group_id, 5, deployments=[new])
    assert got.run.id == run.id and got.deliveries == 1  # the old worker's delivery was undone
    runnable = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="a"))
    (mine,) = await h.engine.dequeue(h.env.worker_group_id, 5, deployments=[old])  # a task it has
    assert mine.run.id == runnable.id


async def test_a_task_the_current_deployment_lacks_waits_for_one_that_has_it(h: Harness) -> None:
    await h.deploy({"id": "a"}, {"id": "b"}, version="v1")
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="b"))
    v2 = await h.deploy({"id": "a"}, version="v2")  # b removed: v2 is current
    h.engine.systems.enqueue.invalidate()
    assert await h.engine.dequeue(h.env.worker_group_id, 5, deployments=[v2]) == []
    row = await h.engine.get_run(run.id)
    assert row is not None and row.status == "PENDING_VERSION" and row.attempt_number == 0
    await h.deploy({"id": "a"}, {"id": "b"}, version="v3")
    (got,) = await h.engine.dequeue(h.env.worker_group_id, 5)
    assert got.run.id == run.id


async def test_a_worker_gives_back_a_run_of_an_environment_it_has_no_deployment_in(h: Harness) -> None:
    """A worker connected while its project had one environment; another environment of the same
    worker group gets a deployment later, served by another worker. The first worker is not
    handed that environment's runs (its executor would fail them as TASK_NOT_FOUND)."""
    repo, org = h.engine.resources.repo, new_id("org")
    dev = await ensure_environment(repo, secret="test-secret", org=org, project="proj", env="dev")
    prod = await ensure_environment(repo, secret="test-secret", org=org, project="proj", env="prod")
    assert prod.worker_group_id == dev.worker_group_id

    async def deploy(env: Environment, task: str, version: str) -> str:
        dep_id, _ = await h.engine.register_deployment(
            env_id=env.env_id, worker_group_id=env.worker_group_id, version=version, content_hash=f"hash-{version}",
            tasks=[TaskDecl.model_validate({"id": task}).spec()], queues=[])
        return dep_id

    mine = await deploy(dev, "a", "1")
    theirs = await deploy(prod, "b", "2")
    run = await h.engine.trigger(TriggerRequest(env_id=prod.env_id, task_id="b"))
    assert await h.engine.dequeue(dev.worker_group_id, 5, deployments=[mine], start=True) == []
    row = await h.engine.get_run(run.id)
    assert row is not None and row.status == "QUEUED" and row.attempt_number == 0
    h.clock.advance(0.6)
    (got,) = await h.engine.dequeue(dev.worker_group_id, 5, deployments=[theirs], start=True)
    assert got.run.id == run.id and got.deliveries == 1


async def test_a_worker_runs_a_new_environments_task_one_of_its_deployments_has(h: Harness) -> None:
    """A worker of identical code connected before the environment existed: its deployment
    elsewhere has the task (its code), so it runs it rather than give it back."""
    repo, org = h.engine.resources.repo, new_id("org")
    dev = await ensure_environment(repo, secret="test-secret", org=org, project="proj", env="dev")
    prod = await ensure_environment(repo, secret="test-secret", org=org, project="proj", env="prod")
    mine, _ = await h.engine.register_deployment(
        env_id=dev.env_id, worker_group_id=dev.worker_group_id, version="1", content_hash="same",
        tasks=[TaskDecl.model_validate({"id": "a"}).spec()], queues=[])
    await h.engine.register_deployment(
        env_id=prod.env_id, worker_group_id=prod.worker_group_id, version="1", content_hash="same",
        tasks=[TaskDecl.model_validate({"id": "a"}).spec()], queues=[])
    run = await h.engine.trigger(TriggerRequest(env_id=prod.env_id, task_id="a"))
    (got,) = await h.engine.dequeue(dev.worker_group_id, 5, deployments=[mine], start=True)
    assert got.run.id == run.id


async def test_a_connect_finding_many_runs_waiting_promotes_a_bounded_number_and_a_job_the_rest(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connect promoted every PENDING_VERSION run of its tasks before answering: a million runs
    triggered before the first deploy took minutes, past the supervisor's 10 s connect timeout
    (it connected again, and again). It promotes CONNECT_PROMOTE now and an engine job the rest, a
    page a turn: every run is enqueued, once."""
    import systems.waiting_for_worker as module

    monkeypatch.setattr(module, "CONNECT_PROMOTE", 3)
    monkeypatch.setattr(module, "PROMOTE_PAGE", 2)
    await h.deploy({"id": "other"}, version="v0")
    runs = [await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="late")) for _ in range(8)]
    assert {(await h.engine.get_run(r.id)).status for r in runs} == {"PENDING_VERSION"}  # type: ignore[union-attr]
    dep_id, enqueued = await h.engine.register_deployment(
        env_id=h.env.env_id, worker_group_id=h.env.worker_group_id, version="v1", content_hash="hash-late",
        tasks=[TaskDecl.model_validate({"id": "late"}).spec()])
    assert enqueued == 3
    for _ in range(10):  # the job's pages, each scheduling the next
        if not await h.advance(0):
            break
    statuses = [(await h.engine.get_run(r.id)).status for r in runs]  # type: ignore[union-attr]
    assert statuses == ["QUEUED"] * 8
    got = await h.engine.dequeue(h.env.worker_group_id, 20, deployments=[dep_id])
    assert sorted(d.run.id for d in got) == sorted(r.id for r in runs)  # each once


async def test_a_connect_that_dies_before_scheduling_its_job_leaves_the_rest_to_the_reconciler(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The connect promoted its CONNECT_PROMOTE runs, then died (or Redis went away) before the
    engine job for the rest was scheduled: nothing else names that job. The reconciler's pass over
    PENDING_VERSION runs a current deployment can run enqueues them, each once."""
    import systems.waiting_for_worker as module

    monkeypatch.setattr(module, "CONNECT_PROMOTE", 3)
    await h.deploy({"id": "other"}, version="v0")
    runs = [await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="late")) for _ in range(8)]

    async def lost(*args: object, **kwargs: object) -> None:
        raise ConnectionError("the process died before the job was scheduled")

    real = h.engine.resources.change_jobs
    monkeypatch.setattr(h.engine.resources, "change_jobs", lost)
    with pytest.raises(ConnectionError):
        await h.engine.register_deployment(
            env_id=h.env.env_id, worker_group_id=h.env.worker_group_id, version="v1", content_hash="hash-late",
            tasks=[TaskDecl.model_validate({"id": "late"}).spec()])
    monkeypatch.setattr(h.engine.resources, "change_jobs", real)
    statuses = [(await h.engine.get_run(r.id)).status for r in runs]  # type: ignore[union-attr]
    assert statuses.count("QUEUED") == 3 and statuses.count("PENDING_VERSION") == 5
    assert not await h.advance(0)  # no job to take the rest
    h.clock.advance(60)  # past the reconciler's grace
    report = await h.engine.systems.reconciler.reconcile(grace_s=-1, full=True)
    assert report.pending_version_enqueued == 5
    statuses = [(await h.engine.get_run(r.id)).status for r in runs]  # type: ignore[union-attr]
    assert statuses == ["QUEUED"] * 8
    dep = await h.engine.resources.repo.deployments.current_task(h.env.env_id, h.env.worker_group_id, "late")
    assert dep is not None
    got = await h.engine.dequeue(h.env.worker_group_id, 20, deployments=[dep.deployment_id])
    assert sorted(d.run.id for d in got) == sorted(r.id for r in runs)  # each once


A_TASKS = ({"id": "shared", "queue": "q", "maxDuration": 60}, {"id": "only-a", "cron": "0 * * * *"})
A_QUEUES = [{"name": "q", "concurrencyLimit": 5}]
B_TASKS = ({"id": "shared", "queue": "q", "maxDuration": 120}, {"id": "only-b", "cron": "30 * * * *"})
B_QUEUES = [{"name": "q", "concurrencyLimit": 10}]


async def _current(h: Harness, task: str) -> str | None:
    found = await h.engine.resources.repo.deployments.current_task(h.env.env_id, h.env.worker_group_id, task)
    return None if found is None else found.deployment_id


async def test_an_old_worker_reconnecting_leaves_the_newer_deployment_current(h: Harness) -> None:
    """A rolling deploy: version B connected after A, then a worker of A restarted (or its
    connection dropped) and connected again. Its connect made A current again: new triggers were
    A's (its task settings), a task only B has waited as PENDING_VERSION, the queue took A's limit
    back and the crons were A's, until B's next connect flipped it all back. A deployment registered
    before the current one stays as it is: still answered, still registered, its workers still run
    what it has."""
    a = await h.deploy(*A_TASKS, queues=A_QUEUES, version="A")
    b = await h.deploy(*B_TASKS, queues=B_QUEUES, version="B")
    assert await h.deploy(*A_TASKS, queues=A_QUEUES, version="A") == a  # A's worker again: A's deployment
    assert await _current(h, "shared") == b and await _current(h, "only-b") == b
    assert await _current(h, "only-a") is None
    deps = h.engine.resources.repo.deployments
    shared = await deps.current_task(h.env.env_id, h.env.worker_group_id, "shared")
    assert shared is not None and shared.version == "B" and shared.max_duration_s == 120
    queue = await deps.task_queue(h.env.env_id, "q")
    assert queue is not None and queue.concurrency_limit == 10  # B's limit, not A's back
    schedules = await h.engine.list_schedules(h.env.env_id, 10, None)
    assert {s.task_id for s in schedules} == {"only-b"}  # B's crons, not A's back
    # triggers go to B's task definitions
    new_task = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="only-b"))
    row = await h.engine.get_run(new_task.id)
    assert row is not None and row.status == "QUEUED" and row.locked_to_deployment_id == b
    plain = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="shared"))
    row = await h.engine.get_run(plain.id)
    assert row is not None and row.locked_to_deployment_id == b
    gone = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="only-a"))
    row = await h.engine.get_run(gone.id)
    assert row is not None and row.status == "PENDING_VERSION"
    # A is still registered: its workers run the tasks it has, a lock to its version still works
    assert await deps.version_task(h.env.env_id, h.env.worker_group_id, "A", "only-a") is not None
    (got,) = await h.engine.dequeue(h.env.worker_group_id, 5, deployments=[a])
    assert got.run.id == plain.id
    # A's connect again, once more: nothing moves (B's workers connecting again neither)
    assert await h.deploy(*A_TASKS, queues=A_QUEUES, version="A") == a
    assert await h.deploy(*B_TASKS, queues=B_QUEUES, version="B") == b
    assert await _current(h, "shared") == b
    row = await h.engine.get_run(gone.id)
    assert row is not None and row.status == "PENDING_VERSION"  # not handed to A's deployment


async def test_a_new_deployment_after_an_old_ones_reconnect_is_current(h: Harness) -> None:
    a = await h.deploy(*A_TASKS, queues=A_QUEUES, version="A")
    b = await h.deploy(*B_TASKS, queues=B_QUEUES, version="B")
    await h.deploy(*A_TASKS, queues=A_QUEUES, version="A")
    c = await h.deploy({"id": "shared"}, {"id": "only-c"}, version="C")
    assert len({a, b, c}) == 3
    assert await _current(h, "shared") == c and await _current(h, "only-c") == c
    for tasks, queues, version in ((A_TASKS, A_QUEUES, "A"), (B_TASKS, B_QUEUES, "B")):
        await h.deploy(*tasks, queues=queues, version=version)
        assert await _current(h, "shared") == c
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="only-c"))
    row = await h.engine.get_run(run.id)
    assert row is not None and row.status == "QUEUED" and row.locked_to_deployment_id == c


async def test_a_deployment_registered_after_the_current_one_is_made_current_by_its_connect(h: Harness) -> None:
    """What the versions before left behind (an old worker's connect made its deployment current
    again): the later deployment's next connect makes it current once more."""
    a = await h.deploy(*A_TASKS, queues=A_QUEUES, version="A")
    b = await h.deploy(*B_TASKS, queues=B_QUEUES, version="B")
    async with h.engine.resources.repo.deployments.pool.connection() as conn, conn.transaction():
        await conn.execute("UPDATE deployment SET is_current = false WHERE id = %s", (b,))
        await conn.execute("UPDATE deployment SET is_current = true WHERE id = %s", (a,))
    assert await _current(h, "shared") == a
    assert await h.deploy(*B_TASKS, queues=B_QUEUES, version="B") == b
    assert await _current(h, "shared") == b


async def test_a_sync_of_crons_that_ends_after_a_newer_deployment_was_made_current_leaves_the_newer_ones(
        h: Harness) -> None:
    """A connect (or promote) of A and one of B take turns under the environment's lock, but each
    syncs its crons after it: A's sync may end after B's, and the schedules were A's while B was
    current, until the next connect or promote. A sync that finds its deployment replaced syncs the
    current one's crons again."""
    a = await h.deploy(*A_TASKS, queues=A_QUEUES, version="A")
    await h.deploy(*B_TASKS, queues=B_QUEUES, version="B")
    wfw = h.engine.systems.waiting_for_worker
    a_tasks = [TaskDecl.model_validate(t).spec() for t in A_TASKS]
    # A's connect committed first, but its sync of crons comes last
    await wfw._apply(h.env.env_id, h.env.worker_group_id, a, a_tasks, wfw._queues(a_tasks, []), current=True)
    schedules = await h.engine.list_schedules(h.env.env_id, 10, None)
    assert {s.task_id for s in schedules} == {"only-b"}
