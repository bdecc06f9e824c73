"""Declarative schedules belong to the worker group whose deployment declared them: an environment
has a current deployment per group, so one group's connect leaves the others' crons alone, and a
tick's run goes to the group that declared its task."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime

import pytest

from run_engine.api.models import TaskDecl
from run_engine.ids import new_id

from .conftest import Harness

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


@pytest.fixture(autouse=True)
def _drop_schedules_after(database_url: str):  # type: ignore[no-untyped-def]
    """Schedules left active would keep firing from any engine of the session."""
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        start = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
    yield
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DELETE FROM task_schedule WHERE created_at >= %s", (start,))


async def declared(h: Harness) -> list[tuple[str, str | None]]:
    rows = await h.engine.resources.repo.schedules.page(h.env.env_id, 10, None)
    return sorted((r.task_id, r.worker_group_id) for r in rows if r.type == "DECLARATIVE")


async def other_group(h: Harness) -> str:
    group = await h.engine.resources.repo.tenancy.create_worker_group(
        new_id("wg"), f"gpu-{h.env.env_id}", h.env.project_id, secrets.token_hex(32), make_default=False)
    return group.id


async def deploy(h: Harness, group_id: str, version: str, *tasks: dict[str, object]) -> None:
    await h.engine.register_deployment(env_id=h.env.env_id, worker_group_id=group_id, version=version,
                                       content_hash=f"{group_id}-{version}",
                                       tasks=[TaskDecl.model_validate(t).spec() for t in tasks], queues=[])


async def test_one_groups_deployment_leaves_another_groups_declared_crons(h: Harness) -> None:
    """A deployment deleted every declarative schedule of its environment whose task it lacked:
    another group's connect removed the default group's crons until its next connect."""
    nightly = {"id": "nightly", "cron": {"pattern": "0 3 * * *", "timezone": "UTC"}}
    await h.deploy({"id": "hello"}, nightly)
    default = h.env.worker_group_id
    assert await declared(h) == [("nightly", default)]
    gpu = await other_group(h)
    await deploy(h, gpu, "g1", {"id": "render", "cron": "*/5 * * * *"})
    assert await declared(h) == [("nightly", default), ("render", gpu)]
    # a group's next version without its cron drops its own schedule only
    await deploy(h, gpu, "g2", {"id": "render"})
    assert await declared(h) == [("nightly", default)]
    await h.deploy({"id": "hello"}, version="2")
    assert await declared(h) == []


async def test_a_tick_of_a_cron_another_group_declared_runs_on_that_group(h: Harness) -> None:
    """Its run went to the environment's default group, whose deployment lacks the task: one more
    run waiting for a version at every tick."""
    await h.deploy({"id": "hello"})
    gpu = await other_group(h)
    await deploy(h, gpu, "g1", {"id": "render", "cron": "* * * * *"})
    (sched,) = [r for r in await h.engine.resources.repo.schedules.page(h.env.env_id, 10, None)
                if r.type == "DECLARATIVE"]
    assert sched.next_run_at is not None
    h.clock.advance((sched.next_run_at - datetime.fromtimestamp(h.clock.now(), UTC)).total_seconds())
    assert await h.engine.systems.schedules.fire_due(jitter_s=0) == 1
    (run,) = await h.engine.resources.repo.runs.list_runs(h.env.env_id, tags=[f"schedule:{sched.id}"], limit=10)
    assert (run.worker_group_id, run.status) == (gpu, "QUEUED")


async def test_a_group_dropping_a_cron_another_groups_deployment_declares_hands_the_schedule_to_it(
        h: Harness) -> None:
    """Declarative schedules are keyed by environment and task: the last group to declare a task's
    cron took the row, and its own drop then deleted it while the other group's current deployment
    still declared it (its ticks lost until that group's next connect)."""
    nightly = {"id": "nightly", "cron": {"pattern": "0 3 * * *", "timezone": "UTC"}}
    # a new version (h.deploy's content hash is its version's: "1" is the fixture's deployment, and
    # the same content is the same deployment, with the tasks it was registered with)
    await h.deploy({"id": "hello"}, nightly, version="2")
    default = h.env.worker_group_id
    (before,) = [r for r in await h.engine.resources.repo.schedules.page(h.env.env_id, 10, None)
                 if r.type == "DECLARATIVE"]
    gpu = await other_group(h)
    await deploy(h, gpu, "g1", nightly)  # the gpu group declares it too: the row is the gpu group's
    assert await declared(h) == [("nightly", gpu)]
    await deploy(h, gpu, "g2", {"id": "nightly"})  # ... and drops it: the default group's again
    assert await declared(h) == [("nightly", default)]
    after = await h.engine.resources.repo.schedules.get(before.id)  # the same schedule, at the same tick
    assert after is not None and after.active and after.next_run_at == before.next_run_at
    assert (after.cron, after.timezone) == ("0 3 * * *", "UTC")
    # its tick's run goes to the default group, which has the task
    assert after.next_run_at is not None
    h.clock.advance((after.next_run_at - datetime.fromtimestamp(h.clock.now(), UTC)).total_seconds())
    await h.engine.systems.schedules.fire_due(jitter_s=0)
    (run,) = await h.engine.resources.repo.runs.list_runs(h.env.env_id, tags=[f"schedule:{after.id}"], limit=10)
    assert run.worker_group_id == default
    # nobody declares it any more: gone
    await h.deploy({"id": "hello"}, {"id": "nightly"}, version="3")
    assert await declared(h) == []


async def test_a_schedule_handed_to_another_group_takes_the_cron_that_group_declares(h: Harness) -> None:
    await h.deploy({"id": "hello"}, {"id": "nightly", "cron": {"pattern": "0 3 * * *", "timezone": "Asia/Tokyo"}},
                   version="2")
    default = h.env.worker_group_id
    gpu = await other_group(h)
    await deploy(h, gpu, "g1", {"id": "nightly", "cron": "*/5 * * * *"})
    (row,) = [r for r in await h.engine.resources.repo.schedules.page(h.env.env_id, 10, None)
              if r.type == "DECLARATIVE"]
    assert (row.worker_group_id, row.cron, row.timezone) == (gpu, "*/5 * * * *", "UTC")
    await deploy(h, gpu, "g2", {"id": "render"})  # the gpu group no longer has the task
    after = await h.engine.resources.repo.schedules.get(row.id)
    assert after is not None and after.next_run_at is not None
    assert (after.worker_group_id, after.cron, after.timezone) == (default, "0 3 * * *", "Asia/Tokyo")
    now = datetime.fromtimestamp(h.clock.now(), UTC)
    assert after.next_run_at > now and (after.next_run_at - now).total_seconds() <= 86400
    assert after.next_run_at.astimezone(UTC).hour == 18 and after.next_run_at.minute == 0  # 03:00 in Tokyo


async def test_a_schedule_is_not_handed_to_a_deployment_no_longer_current(h: Harness) -> None:
    """The hand-over is read, then written: a declaring deployment replaced between the two (its
    group's next version, without the cron) takes nothing, and the schedule nobody declares goes."""
    nightly = {"id": "nightly", "cron": "0 3 * * *"}
    await h.deploy({"id": "hello"}, nightly, version="2")
    gpu = await other_group(h)
    await deploy(h, gpu, "g1", nightly)
    repo = h.engine.resources.repo.schedules
    (dropped,) = await repo.dropped_declarative(h.env.env_id, gpu, [])  # as the gpu group's drop reads it
    assert dropped.worker_group_id == h.env.worker_group_id and dropped.declared_cron == "0 3 * * *"
    await h.deploy({"id": "hello"}, {"id": "nightly"}, version="3")  # meanwhile: the default group's is gone
    assert await declared(h) == [("nightly", gpu)]
    assert await repo.drop_declarative(h.env.env_id, gpu, [], [(dropped, None)]) == (0, 1)
    assert await declared(h) == []
