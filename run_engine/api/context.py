"""What every route needs: the engine, credentials look-ups, run tokens, wake-ups."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
from starlette.requests import Request

from run_engine.api.http import ApiError, TtlCache, bearer
from run_engine.api.inputs import looks_like_id, too_large, too_many_containers
from run_engine.api.public_tokens import (
    LEEWAY_S,
    environment_key,
    forbidden,
    looks_like_jwt,
    token_identity,
    unverified_claims,
    verify,
)
from run_engine.api.stalls import STATE_KEY as STALL_KEY
from run_engine.engine import Environment, RunEngine, WorkerGroup
from run_engine.ratelimit import ConnectionCaps, ReadGate, RequestLimiter, TooMany
from run_engine.realtime import RealtimeHub
from run_engine.run_tokens import RunTokens
from run_engine.tenancy import hash_secret
from run_engine.wakeups import WakeUps

#: what a run token may do (API.md, "Run tokens"); every other public call answers 403
RUN_TOKEN_SCOPE = ("trigger children, create, read and complete waitpoint tokens, update its own run's metadata "
                   "and tags, and read its own run and the runs it triggered")
#: public statuses in which a run's attempt is live (its executor may call with the run token)
_LIVE = frozenset({"EXECUTING", "WAITING"})
#: credential look-ups that missed the caches, in flight at once per process
LOOKUPS_AT_ONCE = 4
#: a credential that matched is looked up without waiting behind a flood for this long after; the
#: mark is kept in Redis too, so that a process just started (a restart, a deploy: every cache
#: empty) does not hold every tenant's first request behind a flood of unknown keys
KNOWN_S = 600.0
#: reads whose cost the tenant's own data decides (realtime shapes, run and token lists, the
#: dashboard's lists) in flight at once per environment, and in all (of a pool of 8 connections by
#: default): a tenant whose reads cost seconds (a million runs of one tag) waits for its own turns,
#: and the environments waiting take the turns given back in rotation (ReadGate)
COSTLY_READS_PER_ENV = 2
COSTLY_READS_AT_ONCE = 4


def costly_read_gate(pool_max: int) -> ReadGate:
    """The gate for a database pool of ``pool_max`` connections: at most half of them for costly
    reads (4 of the default 8), so that a smaller pool still leaves the hot path (trigger, dequeue,
    complete) connections whatever the tenants read; an environment at most half of those."""
    total = max(1, min(COSTLY_READS_AT_ONCE, pool_max // 2))
    return ReadGate(max(1, min(COSTLY_READS_PER_ENV, total // 2)), total)
T = TypeVar("T")
log = logging.getLogger("run_engine.api")


@dataclass(frozen=True, slots=True)
class EnvAuth:
    env_id: str
    project_id: str
    org_id: str
    worker_group_id: str
    run_id: str | None = None  # set when a run token (an executor) made the call
    attempt: int | None = None
    scopes: frozenset[str] | None = None  # set when a public access token made the call (what it may do)
    token_id: str | None = None  # and that token's identity (:func:`token_identity`)

    @classmethod
    def of(cls, env: Environment) -> EnvAuth:
        """The credential of an environment's own secret key."""
        return cls(env.id, env.project_id, env.organization_id, env.default_worker_group_id)

    @property
    def bucket(self) -> str:
        """The credential's share of the limits: the environment (its key and its runs' tokens)."""
        return f"env:{self.env_id}"


@dataclass(eq=False)
class ApiContext:
    engine: RunEngine
    tokens: RunTokens
    wakeups: WakeUps
    public_url: str
    realtime: RealtimeHub | None = None
    limiter: RequestLimiter | None = None
    caps: ConnectionCaps = field(default_factory=lambda: ConnectionCaps({}))
    run_token_ttl_s: int = 24 * 3600
    secret: str = ""  # the installation secret: checks public access tokens (none are accepted without it)
    _envs: TtlCache = field(default_factory=TtlCache)
    _groups: TtlCache = field(default_factory=TtlCache)
    # hashes of keys that matched nothing, refused for a few seconds without a look-up (a client
    # left with a wrong or rotated key retries at full speed, two queries a request)
    _refused: TtlCache = field(default_factory=TtlCache)
    # credential look-ups that missed the caches, in flight at once: a flood of unknown keys (each
    # a miss, two queries) takes a bounded share of the database pool every tenant's work needs
    _lookups: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(LOOKUPS_AT_ONCE))
    # hashes that matched a credential in the last 10 minutes (when this process last marked them in
    # Redis): looked up again (every 5 s) without waiting behind a flood of unknown keys
    _known: TtlCache = field(default_factory=lambda: TtlCache(ttl_s=KNOWN_S))
    _run_groups: dict[str, tuple[str, str]] = field(default_factory=dict)
    costly_reads: ReadGate = field(default_factory=lambda: ReadGate(COSTLY_READS_PER_ENV, COSTLY_READS_AT_ONCE))

    def check_size(self, value: Any, field: str, encoded: bytes | None = None, limit: int | None = None) -> None:
        """413 when ``value`` (or its JSON ``encoded`` already) is over ``limit`` (the payload
        limit when None)."""
        if value is None:
            return
        limit = self.engine.settings.max_payload_bytes if limit is None else limit
        raw = encoded if encoded is not None else orjson.dumps(value)
        if (large := too_large(raw, limit)) is not None:
            raise ApiError(413, "payload_too_large", f"{field}: {large}")
        if (problem := too_many_containers(raw)) is not None:
            raise ApiError(413, "payload_too_large", f"{field}: {problem}")

    def remember_run_group(self, run_id: str, group_id: str, env_id: str) -> None:
        if len(self._run_groups) > 100_000:
            self._run_groups.clear()
        self._run_groups[run_id] = (group_id, env_id)

    def run_group(self, run_id: str) -> tuple[str, str] | None:
        """(worker group, environment) of a run this process handed out."""
        return self._run_groups.get(run_id)

    async def env_auth(self, request: Request, *, run_token: bool = False, public: bool = False,
                       recheck: bool = False, spend: bool = True) -> EnvAuth:
        """The environment of an environment secret key, or of the run of a run token. A run token
        is accepted only where the handler allows it (``run_token``; 403 elsewhere) and only while
        its attempt is live: the run is EXECUTING or WAITING in that attempt (401 after). A public
        access token (a JWT) likewise only where ``public``; the handler then checks its scopes.
        ``recheck``: the credential of a request already let in, checked again (an open stream):
        not counted against its rate, nor as the one use of a one-time token. ``spend`` False:
        counted against its rate, but a one-time token stays unused (a step before the call it is
        for)."""
        auth = await self._env_auth(request, run_token, public, recheck, spend)
        # the key its answers count under should the client stop reading them (api/stalls.py)
        request.scope.setdefault("state", {})[STALL_KEY] = auth.bucket
        return auth

    async def _env_auth(self, request: Request, run_token: bool, public: bool, recheck: bool,
                        spend: bool) -> EnvAuth:
        token = bearer(request)
        if looks_like_jwt(token):
            return await self._public_auth(token, public, recheck, spend)
        if token.startswith("rt_"):
            claims = self.tokens.verify(token, self.engine.now())
            if claims is None:
                raise ApiError(401, "unauthorized", "invalid or expired run token")
            if not run_token:
                raise ApiError(403, "forbidden", f"a run token may only {RUN_TOKEN_SCOPE}")
            run = await self.engine.get_run(claims.run_id) if looks_like_id(claims.run_id, "run") else None
            if run is None:
                raise ApiError(401, "unauthorized", "invalid run token")
            if run.attempt_number != claims.attempt or run.status not in _LIVE:
                raise ApiError(401, "unauthorized", f"the run token's attempt {claims.attempt} has ended "
                                                    f"(the run is {run.status}, attempt {run.attempt_number})")
            env = await self._env_by_id(run.env_id)
            auth = EnvAuth(env.id, env.project_id, env.organization_id, env.default_worker_group_id,
                           run_id=run.id, attempt=claims.attempt)
            if not recheck:
                await self.check_limit(auth.bucket)
            return auth
        token_hash = hash_secret(token)
        if self._refused.get(token_hash):
            raise ApiError(401, "unauthorized", "invalid API key")
        found = await self.environment_by_key(token)
        if found is None:
            if await self._look_up(self.engine.worker_group_by_token_hash, token_hash) is not None:
                raise ApiError(403, "forbidden", "a worker group token cannot call the public API")
            self._refused.put(token_hash, True)
            raise ApiError(401, "unauthorized", "invalid API key")
        auth = EnvAuth.of(found)
        if not recheck:
            await self.check_limit(auth.bucket)
        return auth

    async def _public_auth(self, token: str, allowed: bool, recheck: bool = False, spend: bool = True) -> EnvAuth:
        claims = unverified_claims(token)
        env = await self._token_environment(claims["sub"])
        key = (environment_key(self.secret, env.id, env.type, env.api_key_generation, env.api_key_hash)
               if env is not None and self.secret else None)
        if env is None or key is None:
            raise ApiError(401, "unauthorized", "invalid public access token: unknown environment")
        checked = verify(token, key, claims, self.engine.now())
        if not allowed:
            raise forbidden()
        auth = EnvAuth(env.id, env.project_id, env.organization_id, env.default_worker_group_id,
                       scopes=checked.scopes, token_id=token_identity(token))
        if recheck:
            return auth
        await self.check_limit(auth.bucket)
        if checked.one_time and spend:
            used = self.engine.redis.set(f"{self.engine.settings.key_prefix}:otu:{hash_secret(token)}", "1",
                                         nx=True, exat=checked.expires_at + LEEWAY_S + 1)
            if not await used:
                raise ApiError(401, "unauthorized", "this one-time public access token has been used")
        return auth

    def public_key(self, env: Environment) -> str | None:
        """The key public tokens of ``env`` are signed with (its secret API key), or None."""
        if not self.secret:
            return None
        return environment_key(self.secret, env.id, env.type, env.api_key_generation, env.api_key_hash)

    async def check_limit(self, bucket: str) -> None:
        """429 when the credential ``bucket`` is over its request rate."""
        if self.limiter is not None and (wait_s := await self.limiter.retry_after_s(bucket)) is not None:
            raise ApiError(429, "rate_limited", f"too many requests with this credential; retry in {wait_s} s",
                           headers={"Retry-After": str(wait_s)})

    @contextlib.contextmanager
    def hold(self, kind: str, bucket: str) -> Iterator[None]:
        """Count an open long-poll or stream of a credential; 429 over its cap."""
        try:
            with self.caps.hold(kind, bucket):
                yield
        except TooMany as exc:
            raise ApiError(429, "too_many_open", str(exc), headers={"Retry-After": "1"}) from None

    def acquire(self, kind: str, bucket: str) -> Callable[[], None]:
        """Like :meth:`hold` for a response that outlives the handler (a stream): returns the
        release, which may be called more than once."""
        cm = self.hold(kind, bucket)
        cm.__enter__()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                cm.__exit__(None, None, None)

        return release

    async def _env_by_id(self, env_id: str) -> Environment:
        env = await self.environment(env_id)
        if env is None:
            raise ApiError(401, "unauthorized", "unknown environment")
        return env

    async def environment(self, env_id: str) -> Environment | None:
        """An environment by id (cached a few seconds)."""
        env: Environment | None = self._envs.get(env_id)
        if env is None:
            env = await self.engine.environment(env_id)
            if env is not None:
                self._envs.put(env_id, env)
        return env

    async def _token_environment(self, env_id: Any) -> Environment | None:
        """The environment a public token names, before its signature is checked: anyone can send
        one, so a miss takes a look-up slot as an unknown key does, and is remembered as refused."""
        if not isinstance(env_id, str) or not looks_like_id(env_id, "env") or self._refused.get(f"env:{env_id}"):
            return None
        env: Environment | None = self._envs.get(env_id)
        if env is None:
            env = await self._look_up(self.engine.environment, env_id)
            if env is None:
                self._refused.put(f"env:{env_id}", True)
                return None
            self._envs.put(env_id, env)
        return env

    async def _look_up(self, find: Callable[[str], Awaitable[T | None]], key_hash: str) -> T | None:
        """A credential look-up that missed the caches, at most LOOKUPS_AT_ONCE in flight; a hash
        that matched a credential lately (in this process, or in any: Redis, asked only while the
        slots are all taken) is looked up at once."""
        marked_at = self._known.get(key_hash)
        if marked_at is not None or (self._lookups.locked() and await self._known_elsewhere(key_hash)):
            found = await find(key_hash)
        else:
            async with self._lookups:
                found = await find(key_hash)
        if found is not None:
            now = time.monotonic()
            if marked_at is None or now - marked_at > KNOWN_S / 2:
                await self._mark_known(key_hash)
                marked_at = now
            self._known.put(key_hash, marked_at)
        return found

    def _known_key(self, key_hash: str) -> str:
        # a digest of the stored hash, not the hash itself: Redis's data names no credential's row
        digest = hashlib.sha256(f"known:{key_hash}".encode()).hexdigest()[:32]
        return f"{self.engine.settings.key_prefix}:cred:known:{digest}"

    async def _known_elsewhere(self, key_hash: str) -> bool:
        try:
            return bool(await self.engine.redis.exists(self._known_key(key_hash)))
        except Exception as exc:  # noqa: BLE001 (Redis away: the look-up waits its turn, as before)
            log.debug("credential mark unreadable: %r", exc)
            return False

    async def _mark_known(self, key_hash: str) -> None:
        try:
            await self.engine.redis.set(self._known_key(key_hash), 1, ex=int(KNOWN_S))
        except Exception as exc:  # noqa: BLE001 (the mark is a courtesy to the next process)
            log.debug("credential mark not written: %r", exc)

    async def environment_by_key(self, key: str) -> Environment | None:
        """The environment of a secret API key (cached a few seconds), or None."""
        key_hash = hash_secret(key)
        found: Environment | None = self._envs.get(key_hash)
        if found is None:
            found = await self._look_up(self.engine.environment_by_key_hash, key_hash)
            if found is not None:
                self._envs.put(key_hash, found)
        return found

    async def worker_group(self, request: Request) -> WorkerGroup:
        token = bearer(request)
        if token.startswith("rt_") and self.tokens.verify(token, self.engine.now()) is not None:
            raise ApiError(403, "forbidden", "a run token cannot call the worker API")
        token_hash = hash_secret(token)
        if self._refused.get(token_hash):
            raise ApiError(401, "unauthorized", "invalid worker group token")
        group: WorkerGroup | None = self._groups.get(token_hash)
        if group is None:
            group = await self._look_up(self.engine.worker_group_by_token_hash, token_hash)
            if group is None:
                if await self._look_up(self.engine.environment_by_key_hash, token_hash) is not None:
                    raise ApiError(403, "forbidden", "an environment API key cannot call the worker API")
                self._refused.put(token_hash, True)  # matched nothing: refused a few seconds unseen
                raise ApiError(401, "unauthorized", "invalid worker group token")
            self._groups.put(token_hash, group)
        await self.check_limit(worker_bucket(group))
        return group


def worker_bucket(group: WorkerGroup) -> str:
    """A worker token's share of the limits: its group (and environment, for a scoped token)."""
    scoped = group.scoped_env_id
    return f"wg:{group.id}" + (f":{scoped}" if scoped else "")


def ctx_of(request: Request) -> ApiContext:
    """The API context of the app serving ``request``."""
    ctx: ApiContext = request.app.state.ctx
    return ctx

