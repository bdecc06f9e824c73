"""RunLocker: RedLock over one or more independent Redis nodes.

* A lock on several resources is all-or-nothing; it is held when a quorum (n//2 + 1) of nodes
  granted it within its validity (ttl − elapsed − clock drift).
* Re-entrant: inside ``async with locker.lock(...)`` a nested lock on resources the task already
  holds runs at once, with no round trip (the held set lives in a context variable).
* One background loop extends every held lock that is near expiry, in one call per node, so a
  long holder keeps its lock; a lock that could not be extended is marked ``lost`` and logged.
* Acquisition retries with jittered exponential back-off and ends in :class:`LockTimeoutError`.
* Concurrent acquisitions and releases are coalesced: one Lua call per node carries many requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import random
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from redis.asyncio import Redis

from run_engine.batching import Batcher
from run_engine.errors import LockTimeoutError
from run_engine.lua_scripts import LuaScript
from run_engine.tasks import stop_task
from run_engine.timings import TIMINGS

log = logging.getLogger(__name__)
T = TypeVar("T")
UNREACHABLE_LOG_S = 60.0

# (owner task, resources): re-entrancy is for nested calls in the same asyncio task only; a task
# started inside a lock copies the context but is not the owner, so it must acquire for itself.
_HELD: contextvars.ContextVar[tuple[object, frozenset[str]]] = contextvars.ContextVar(
    "run_engine_locks_held", default=(None, frozenset()))


def _held_here() -> frozenset[str]:
    owner, resources = _HELD.get()
    return resources if owner is not None and owner is asyncio.current_task() else frozenset()


@dataclass(frozen=True, slots=True)
class LockSettings:
    duration_s: float = 5.0
    extend_before_s: float = 1.0
    max_attempts: int = 10
    base_delay_s: float = 0.1
    max_delay_s: float = 3.0
    multiplier: float = 1.8
    jitter: float = 0.15
    max_total_wait_s: float = 15.0
    drift_factor: float = 0.01


@dataclass(eq=False, slots=True)
class LockHandle:
    resources: tuple[str, ...]
    keys: tuple[str, ...]
    token: str
    expires_at: float = 0.0  # monotonic
    lost: bool = False
    released: bool = False
    extending: bool = field(default=False)


class RunLocker:
    def __init__(self, nodes: Sequence[Redis], *, prefix: str, settings: LockSettings | None = None,
                 rng: random.Random | None = None) -> None:
        if not nodes:
            raise ValueError("RunLocker needs at least one Redis node")
        self.nodes = list(nodes)
        self.prefix = prefix
        self.settings = settings or LockSettings()
        self.quorum = len(self.nodes) // 2 + 1
        self._rng = rng or random.Random()
        self._acquire_script = LuaScript.get("lock_acquire")
        self._release_script = LuaScript.get("lock_release")
        self._extend_script = LuaScript.get("lock_extend")
        self._acquirer: Batcher[LockHandle, bool] = Batcher(self._acquire_batch, max_batch=500, split=False)
        self._releaser: Batcher[LockHandle, None] = Batcher(self._release_batch, max_batch=500)
        self._active: set[LockHandle] = set()
        self._giving_back: set[asyncio.Task[None]] = set()  # releases of locks taken for a cancelled caller
        self._warned: dict[int, float] = {}  # node index → when its being unreachable was last logged
        self._extender: asyncio.Task[None] | None = None

    # --- public -------------------------------------------------------------------------------

    def is_held(self, resource: str) -> bool:
        return self.key(resource) in _held_here()

    def key(self, resource: str) -> str:
        """The lock key of ``resource``: every lock key carries the hash tag ``{lock}``, so the keys
        of one request (and of one batched call) share a slot on a Redis Cluster."""
        return f"{self.prefix}:{{lock}}:{resource}"

    @contextlib.asynccontextmanager
    async def lock(self, name: str, *resources: str) -> AsyncIterator[LockHandle | None]:
        """Hold ``resources`` for the body; ``name`` says what for (logs, errors)."""
        held = _held_here()
        missing = tuple(sorted(r for r in set(resources) if self.key(r) not in held))
        if not missing:
            yield None
            return
        handle = await self._acquire(name, missing)
        token = _HELD.set((asyncio.current_task(), held | set(handle.keys)))
        try:
            yield handle
        finally:
            _HELD.reset(token)
            await self._release(handle)

    async def start(self) -> None:
        if self._extender is None:
            self._extender = asyncio.create_task(self._extend_loop())

    async def stop(self) -> None:
        task, self._extender = self._extender, None
        await stop_task(task)
        for handle in list(self._active):
            await self._release(handle)

    async def _on_node(self, call: Awaitable[T]) -> T:
        """One node's answer, bounded in time: a dead node must not eat the lock's validity."""
        if len(self.nodes) == 1:  # no quorum to protect: the client's own timeouts apply
            return await call
        return await asyncio.wait_for(call, timeout=max(0.05, self.settings.duration_s * 0.2))

    # --- acquire / release ----------------------------------------------------------------------

    async def _acquire(self, name: str, resources: tuple[str, ...]) -> LockHandle:
        s = self.settings
        handle = LockHandle(resources, tuple(self.key(r) for r in resources), secrets.token_hex(10))
        asked = time.monotonic()
        waited = 0.0
        attempts = 0
        while True:
            attempts += 1
            if await self._try(handle):
                self._active.add(handle)
                TIMINGS.lock_wait(name, time.monotonic() - asked)
                return handle
            if attempts > s.max_attempts or waited >= s.max_total_wait_s:
                raise LockTimeoutError(resources, waited, attempts)
            delay = min(s.base_delay_s * s.multiplier ** (attempts - 1), s.max_delay_s)
            delay = max(0.0, delay + delay * s.jitter * self._rng.uniform(-1, 1))
            delay = min(delay, max(0.0, s.max_total_wait_s - waited))
            waited += delay
            log.debug("lock %s on %s busy; retry in %.3fs", name, resources, delay)
            await asyncio.sleep(delay)

    async def _try(self, handle: LockHandle) -> bool:
        """One attempt at ``handle``'s keys, with the batch of this moment. A caller cancelled
        meanwhile does not stop the batch, which may take the keys all the same: they are given
        back then (else nobody would hold, extend or release them until they expire)."""
        attempt = self._acquirer.submit_many_now([handle])
        try:
            (ok,) = await asyncio.shield(attempt)
        except asyncio.CancelledError:
            def give_back(done: asyncio.Future[list[bool]]) -> None:
                if not done.cancelled() and done.exception() is None and done.result()[0]:
                    task = asyncio.ensure_future(self._release(handle))
                    self._giving_back.add(task)
                    task.add_done_callback(self._giving_back.discard)

            attempt.add_done_callback(give_back)
            raise
        return ok

    async def _acquire_batch(self, handles: list[LockHandle]) -> list[bool]:
        s = self.settings
        ttl_ms = int(s.duration_s * 1000)
        keys: list[str] = []
        args: list[str | int] = [ttl_ms]
        for h in handles:
            keys += h.keys
            args += [h.token, len(h.keys)]
        started = time.monotonic()
        replies = await asyncio.gather(
            *(self._on_node(self._acquire_script(node, keys, args)) for node in self.nodes), return_exceptions=True)
        elapsed = time.monotonic() - started
        validity = s.duration_s - elapsed - s.duration_s * s.drift_factor - 0.002
        granted = [0] * len(handles)
        for node, reply in enumerate(replies):
            if isinstance(reply, BaseException):
                self._unreachable(node, reply)
                continue
            for i, ok in enumerate(reply):
                granted[i] += int(ok)
        results = []
        undo = []
        for h, count in zip(handles, granted, strict=True):
            ok = count >= self.quorum and validity > 0
            if ok:
                h.expires_at = started + validity
            elif count:
                undo.append(h)
            results.append(ok)
        if undo:
            await self._release_batch(undo)
        return results

    def _unreachable(self, node: int, error: BaseException) -> None:
        """Log a node that did not answer, once a minute per node (every lock call would otherwise)."""
        now = time.monotonic()
        if now - self._warned.get(node, -UNREACHABLE_LOG_S) >= UNREACHABLE_LOG_S:
            self._warned[node] = now
            log.warning("lock node %d of %d unreachable (locks go on while a majority answers): %s",
                        node + 1, len(self.nodes), error)

    async def _release(self, handle: LockHandle) -> None:
        if handle.released:
            return
        handle.released = True
        self._active.discard(handle)
        try:
            await self._releaser.submit(handle)
        except Exception:  # the lock expires by itself; a failed release must not fail the work
            log.warning("could not release lock on %s", handle.resources, exc_info=True)

    async def _release_batch(self, handles: list[LockHandle]) -> list[None]:
        keys = [k for h in handles for k in h.keys]
        tokens = [h.token for h in handles for _ in h.keys]
        await asyncio.gather(*(self._on_node(self._release_script(node, keys, tokens)) for node in self.nodes),
                             return_exceptions=True)
        return [None] * len(handles)

    # --- extension ----------------------------------------------------------------------------

    async def _extend_loop(self) -> None:
        s = self.settings
        interval = max(0.02, min(0.5, s.extend_before_s / 3))
        while True:
            await asyncio.sleep(interval)
            due = [h for h in self._active if not h.lost and h.expires_at - time.monotonic() < s.extend_before_s]
            if due:
                try:
                    await self._extend(due)
                except Exception:
                    log.exception("lock extension failed")

    async def _extend(self, handles: list[LockHandle]) -> None:
        s = self.settings
        keys = [k for h in handles for k in h.keys]
        args: list[str | int] = [int(s.duration_s * 1000)] + [h.token for h in handles for _ in h.keys]
        started = time.monotonic()
        replies = await asyncio.gather(*(self._on_node(self._extend_script(node, keys, args)) for node in self.nodes),
                                       return_exceptions=True)
        validity = s.duration_s - (time.monotonic() - started) - s.duration_s * s.drift_factor
        offset = 0
        for h in handles:
            start, offset = offset, offset + len(h.keys)
            if h.released:
                continue
            votes = 0
            for reply in replies:
                if not isinstance(reply, BaseException) and all(reply[start:offset]):
                    votes += 1
            if votes >= self.quorum:
                h.expires_at = started + validity
            elif time.monotonic() >= h.expires_at:
                h.lost = True
                log.error("lost the lock on %s: it could not be extended", h.resources)
