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
