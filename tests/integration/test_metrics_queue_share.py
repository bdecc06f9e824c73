"""The queues /metrics reads (run_engine/gauges.py: at most MAX_QUEUES a scrape) are shared out among
the environments with runs: each one's first queues before any one's next. Taken in environment id
order, one tenant of as many queues as the bound (RUN_ENGINE_MAX_QUEUES_PER_ENV allows 10,000)
whose id sorts first left every other environment's queue gauges out of every scrape."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from run_engine import gauges
from run_engine.api.models import TaskDecl
from run_engine.engine import TriggerRequest
from run_engine.tenancy import Environment, ensure_environment

from .conftest import Harness

CROWDED = [f"q{i:02}" for i in range(12)]  # (and each environment has its task's own queue, task/hello)


async def _two(make_engine: Callable[..., Any], unique: str) -> tuple[Harness, Environment, Environment]:
    """Two environments with runs queued: the one whose id sorts first in 12 queues, the other in one."""
    h: Harness = await make_engine()
    other = await ensure_environment(h.engine.resources.repo, secret="test-secret", org=f"org-{unique}",
                                     project="proj", env="prod")
    crowded, quiet = sorted([h.env, other], key=lambda e: e.env_id)
    for env, queues in ((crowded, CROWDED), (quiet, ["only"])):
        await h.engine.register_deployment(env_id=env.env_id, worker_group_id=env.worker_group_id, version="1",
                                           content_hash=f"hash-{env.env_id}",
                                           tasks=[TaskDecl.model_validate({"id": "hello"}).spec()])
        await h.engine.trigger_many([TriggerRequest(env_id=env.env_id, task_id="hello", queue=q) for q in queues])
    return h, crowded, quiet


async def test_a_scrape_shows_every_active_environments_queues_past_one_with_many(
        make_engine: Callable[..., Any], unique: str, monkeypatch: pytest.MonkeyPatch) -> None:
    h, crowded, quiet = await _two(make_engine, unique)
    monkeypatch.setattr(gauges, "MAX_QUEUES", 5)
    tenancy = h.engine.resources.repo.tenancy

    async def these(limit: int) -> list[str]:  # (the database is shared: only this test's environments)
        return [crowded.env_id, quiet.env_id]

    monkeypatch.setattr(tenancy, "environment_ids", these)
    families = {f.name: f for f in await gauges.collect(h.engine)}
    queued = {(s.labels["env_id"], s.labels["queue"]): s.value
              for s in families["run_engine_queue_runs_queued"].samples}
    assert queued.get((quiet.env_id, "only")) == 1
    assert len(queued) == 5 and [q for e, q in queued if e == crowded.env_id] == CROWDED[:3]
    truncated = {s.labels["what"]: s.value for s in families["run_engine_metrics_truncated"].samples}
    assert truncated["queues"] == 1


async def test_the_share_fills_the_bound_and_says_when_queues_were_left_out(
        make_engine: Callable[..., Any], unique: str) -> None:
    h, crowded, quiet = await _two(make_engine, unique)
    queue_names = h.engine.resources.repo.deployments.queue_names
    everything = sorted([(crowded.env_id, q) for q in [*CROWDED, "task/hello"]]
                        + [(quiet.env_id, "only"), (quiet.env_id, "task/hello")])
    for order in ([crowded.env_id, quiet.env_id], [quiet.env_id, crowded.env_id]):
        names, more = await queue_names(order, 15)
        assert sorted(names) == everything and not more
        names, more = await queue_names(order, 14)  # one fewer than there are: one left out, said so
        assert len(names) == 14 and (quiet.env_id, "only") in names and more
    names, more = await queue_names([crowded.env_id, quiet.env_id], 2)
    assert sorted(names) == sorted([(crowded.env_id, "q00"), (quiet.env_id, "only")]) and more
