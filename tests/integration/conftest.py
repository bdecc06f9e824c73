"""An engine over the session's real PostgreSQL and Redis, with a fake clock and the job worker
switched off, so tests drive timeouts step by step."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from run_engine.clock import FakeClock
from run_engine.events import RunEvent
from run_engine.settings import EngineSettings, RetryPolicy
from run_engine.tenancy import Environment, ensure_environment

if TYPE_CHECKING:
    from run_engine.engine import RunEngine


@dataclass
class Harness:
    engine: RunEngine
    clock: FakeClock
    env: Environment
    events: list[RunEvent] = field(default_factory=list)

    def names(self, run_id: str) -> list[str]:
        return [e.name for e in self.events if e.run_id == run_id]

    async def deploy(self, *tasks: dict[str, Any], queues: list[dict[str, Any]] | None = None,
                     version: str = "1") -> str:
        """Register a deployment; tasks and queues as a worker declares them (API.md's JSON)."""
        from run_engine.api.models import QueueOption, TaskDecl

        dep_id, _ = await self.engine.register_deployment(
            env_id=self.env.env_id, worker_group_id=self.env.worker_group_id, version=version,
            content_hash=f"hash-{version}", tasks=[TaskDecl.model_validate(t).spec() for t in tasks],
            queues=[QueueOption.model_validate(q).spec() for q in queues or []])
        return dep_id

    async def statuses(self, run_id: str) -> list[str]:
        return [s.engine_status for s in await self.engine.snapshots(run_id)]

    async def advance(self, seconds: float) -> int:
        """Move the fake clock and run the engine jobs that became due."""
        self.clock.advance(seconds)
        return await self.engine.run_due_jobs()


@pytest.fixture
async def make_engine(database_url: str, redis_url: str, key_prefix: str,
                      unique: str) -> AsyncIterator[Callable[..., Any]]:
    engines: list[RunEngine] = []

    async def make(**overrides: Any) -> Harness:
        settings = EngineSettings(
            database_url=database_url, redis_url=redis_url, key_prefix=f"{key_prefix}:{unique}",
            default_retry=RetryPolicy(max_attempts=3, factor=2, min_timeout_s=1, max_timeout_s=10, randomize=False),
            **overrides,
        )
        from run_engine.engine import RunEngine

        clock = FakeClock()
        engine = await RunEngine.create(settings, clock=clock, run_jobs=False)
        engines.append(engine)
        env = await ensure_environment(engine.resources.repo, secret="test-secret", org=f"org-{unique}", project="proj",
                                       env="dev")
        harness = Harness(engine, clock, env)
        engine.events.subscribe("*", harness.events.append)
        return harness

    yield make
    for engine in engines:
        await engine.close()


@pytest.fixture
async def h(make_engine: Callable[..., Any]) -> Harness:
    harness: Harness = await make_engine()
    await harness.deploy({"id": "hello"}, {"id": "limited", "queue": "limited"},
                         queues=[{"name": "limited", "concurrencyLimit": 1}])
    return harness


@contextlib.asynccontextmanager
async def api_client(h: Harness, credential: str | None = None) -> AsyncIterator[httpx.AsyncClient]:
    """The HTTP API over the harness's engine, in process, with ``credential`` (the environment's
    API key when None; the server's public URL is http://t)."""
    from run_engine.api.app import create_app
    from run_engine.api.context import ApiContext
    from run_engine.run_tokens import RunTokens
    from run_engine.wakeups import WakeUps

    ctx = ApiContext(engine=h.engine, tokens=RunTokens("test-secret"),
                     wakeups=WakeUps(h.engine.redis, channel=f"{h.engine.resources.settings.key_prefix}:wake"),
                     public_url="http://t", secret="test-secret")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)), base_url="http://t",
                                 headers={"Authorization": f"Bearer {credential or h.env.api_key}"}) as c:
        yield c


@pytest.fixture
async def api(h: Harness) -> AsyncIterator[httpx.AsyncClient]:
    """:func:`api_client` with the environment's API key."""
    async with api_client(h) as c:
        yield c


#: the fake clock's start in the engine jobs' tests
JOBS_T0 = 1_700_000_000.0


@pytest.fixture
def clock() -> FakeClock:
    """A fake clock at JOBS_T0 (the engine jobs' tests)."""
    return FakeClock(JOBS_T0)


@pytest.fixture
def jobs(redis_client: Any, key_prefix: str, unique: str, clock: FakeClock) -> Any:
    """An engine job queue of the test's own on real Redis, on ``clock``: 3 attempts, back-off 1 s doubling."""
    from run_engine.jobs import JobQueue

    return JobQueue(redis_client, prefix=f"{key_prefix}:j{unique}", clock=clock, max_attempts=3,
                    min_retry_s=1, factor=2)

