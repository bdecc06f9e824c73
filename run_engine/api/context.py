"""What every route needs: the engine, credentials look-ups, run tokens, wake-ups."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from run_engine.api.http import ApiError, TtlCache, bearer
from run_engine.engine import RunEngine
from run_engine.realtime import RealtimeHub
from run_engine.run_tokens import RunTokens
from run_engine.tenancy import hash_secret
from run_engine.wakeups import WakeUps


@dataclass(frozen=True, slots=True)
class EnvAuth:
    env_id: str
    project_id: str
    org_id: str
    worker_group_id: str
    run_id: str | None = None  # set when a run token (an executor) made the call


@dataclass(eq=False)
class ApiContext:
    engine: RunEngine
    tokens: RunTokens
    wakeups: WakeUps
    public_url: str
    realtime: RealtimeHub | None = None
    run_token_ttl_s: int = 24 * 3600
    _envs: TtlCache = field(default_factory=TtlCache)
    _groups: TtlCache = field(default_factory=TtlCache)
    _run_groups: dict[str, str] = field(default_factory=dict)

    def remember_run_group(self, run_id: str, group_id: str) -> None:
        if len(self._run_groups) > 100_000:
            self._run_groups.clear()
        self._run_groups[run_id] = group_id

    def run_group(self, run_id: str) -> str | None:
        return self._run_groups.get(run_id)

    @property
    def repo(self):  # type: ignore[no-untyped-def]
        return self.engine.resources.repo

    async def env_auth(self, request: Request) -> EnvAuth:
        """The environment of an environment secret key, or of the run of a run token."""
        token = bearer(request)
        if token.startswith("rt_"):
            claims = self.tokens.verify(token, self.engine.resources.clock.now())
            if claims is None:
                raise ApiError(401, "unauthorized", "invalid or expired run token")
            run = await self.engine.get_run(claims.run_id)
            if run is None:
                raise ApiError(401, "unauthorized", "invalid run token")
            env = await self._env_by_id(run.environment_id)
            return EnvAuth(env["id"], env["project_id"], env["organization_id"], env["default_worker_group_id"],
                           run_id=run.id)
        key_hash = hash_secret(token)
        env = self._envs.get(key_hash)
        if env is None:
            env = await self.repo.environment_by_key_hash(key_hash)
            if env is None:
                if await self.repo.worker_group_by_token_hash(key_hash) is not None:
                    raise ApiError(403, "forbidden", "a worker group token cannot call the public API")
                raise ApiError(401, "unauthorized", "invalid API key")
            self._envs.put(key_hash, env)
        return EnvAuth(env["id"], env["project_id"], env["organization_id"], env["default_worker_group_id"])

    async def _env_by_id(self, env_id: str) -> dict[str, Any]:
        env = self._envs.get(env_id)
        if env is None:
            env = await self.repo.environment(env_id)
            if env is None:
                raise ApiError(401, "unauthorized", "unknown environment")
            env = {**env, "organization_id": ""}
            self._envs.put(env_id, env)
        return env

    async def worker_group(self, request: Request) -> dict[str, Any]:
        token = bearer(request)
        token_hash = hash_secret(token)
        group = self._groups.get(token_hash)
        if group is None:
            group = await self.repo.worker_group_by_token_hash(token_hash)
            if group is None:
                if await self.repo.environment_by_key_hash(token_hash) is not None:
                    raise ApiError(403, "forbidden", "an environment API key cannot call the worker API")
                raise ApiError(401, "unauthorized", "invalid worker group token")
            self._groups.put(token_hash, group)
        return group
