"""Leader lease (the dex technique): one row per lease name in the UNLOGGED ``engine_lease`` table.
A candidate takes the lease when it is free or expired and its holder extends it; time is
PostgreSQL's, so the candidates' clocks do not matter. The holder counts itself leader only until
``ttl_s`` after it sent its last successful take or renewal (by its own monotonic clock, which
runs on through a pause): a process stopped past its lease's end (SIGSTOP, a long GC, a blocked
event loop, a renewal stuck waiting for a connection) runs no duty when it resumes, before it has
asked again. Work that must run once per cluster
(reconciler, retention) runs only on the holder; schedule planning runs on every process (a
tick's idempotency key makes one run of it, `systems/schedules.py`).

Each duty's run is a task of its own, bounded by the duty's timeout: one that hangs (a statement
behind a lock, a Redis call that never answers) is cancelled when its time is up, and the others
keep their intervals meanwhile. Duties are fenced by the lease: when this process stops leading (a
renewal refused or failed, or its monotonic validity passed) the runs under way are cancelled
within a second and none starts until it leads again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable

from run_engine.db.repository import Repository
from run_engine.dependencies import log_failure
from run_engine.ids import new_id
from run_engine.tasks import stop_task
from run_engine.timings import TIMINGS

log = logging.getLogger(__name__)

Duty = tuple[str, float, Callable[[], Awaitable[object]], float]  # name, interval s, coroutine function, timeout s
#: how often at least the duties' task looks whether this process still leads (a lost renewal: the
#: lease's loop cancels the duties at once; a validity passing: the duties' task wakes at its end)
FENCE_CHECK_S = 1.0


def default_duty_timeout(interval_s: float) -> float:
    """A duty's timeout unless ``add_duty`` is given one: ten intervals, at least a minute."""
    return max(60.0, 10 * interval_s)


class LeaderLease:
    def __init__(self, repo: Repository, *, name: str = "engine", ttl_s: float = 30.0, renew_s: float = 15.0,
                 holder: str | None = None) -> None:
        self.repo = repo
        self.name = name
        self.ttl_s = ttl_s
        self.renew_s = renew_s
        self.holder = holder or f"{socket.gethostname()}-{os.getpid()}-{new_id('lease')[-6:]}"
        self._held = False  # the last take or renewal succeeded
        self._term = 0  # counts the takes: a duties' task serves the term it was started in only
        self._valid_until = 0.0  # time.monotonic() at which that lease ends at the latest
        self._duties: list[Duty] = []
        self._last_run: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._duty_task: asyncio.Task[None] | None = None
        self._duty_term = 0
        self._stopping = False

    @property
    def is_leader(self) -> bool:
        """Whether this process holds the lease now: its last take or renewal succeeded and was
        sent less than ``ttl_s`` ago."""
        return self._held and time.monotonic() < self._valid_until

    def add_duty(self, name: str, interval_s: float, fn: Callable[[], Awaitable[object]], *,
                 timeout_s: float | None = None) -> None:
        """Run ``fn`` every ``interval_s`` while this process leads (never two runs at once); a run
        still going after ``timeout_s`` (default :func:`default_duty_timeout`) is cancelled."""
        timeout = default_duty_timeout(interval_s) if timeout_s is None else timeout_s
        self._duties.append((name, interval_s, fn, timeout))

    async def try_acquire(self) -> float:
        """Take or extend the lease; returns seconds until it is worth trying again."""
        sent = time.monotonic()  # the lease ends ttl_s after PostgreSQL's now(), which is later
        held, expires_in = await self.repo.maintenance.acquire_lease(self.name, self.holder, self.ttl_s)
        if held != self.is_leader:
            log.info("%s %s the %r lease", self.holder, "took" if held else "lost", self.name)
        if held and not self.is_leader:
            self._term += 1
        self._held = held
        self._valid_until = sent + self.ttl_s if held else 0.0
        if held:
            return self.renew_s
        # someone else holds it: try again as soon as it can have expired, at most every renew_s
        return max(0.05, min(self.renew_s, expires_in + 0.05))

    async def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(self._loop(), name="leader-lease")

    async def _loop(self) -> None:
        while not self._stopping:
            try:
                wait = await self.try_acquire()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log_failure(log, exc, "lease %r: could not be taken or renewed", self.name)
                self._held = False
                wait = 1.0
            if not self.is_leader:
                await stop_task(self._duty_task)  # fenced: the duties under way are cancelled now
            elif self._duty_task is None or self._duty_task.done() or self._duty_term != self._term:
                await stop_task(self._duty_task)  # (one of a term before this one)
                self._duty_term = self._term
                self._duty_task = asyncio.create_task(self._run_duties(self._term), name="leader-duties")
            await asyncio.sleep(wait)

    def _leads(self, term: int) -> bool:
        return self.is_leader and self._term == term and not self._stopping

    async def _run_duties(self, term: int) -> None:
        """Start each duty on its own interval, each run a task of its own, for as long as this
        process leads in ``term`` (looked at every FENCE_CHECK_S at least); then cancel the runs."""
        runs: dict[str, asyncio.Task[None]] = {}
        try:
            while self._leads(term):
                now = time.monotonic()
                wake = [FENCE_CHECK_S, self._valid_until - now]  # and the next duty due, or a run's end
                for name, interval, fn, timeout in self._duties:
                    if name in runs and not runs[name].done():
                        continue
                    if now - self._last_run.get(name, -1e9) >= interval:
                        self._last_run[name] = now
                        runs[name] = asyncio.create_task(self._run_duty(name, fn, timeout), name=f"leader duty {name}")
                    wake.append(self._last_run[name] + interval - now)
                under_way = [run for run in runs.values() if not run.done()]
                if under_way:
                    await asyncio.wait(under_way, timeout=max(0.0, min(wake)), return_when=asyncio.FIRST_COMPLETED)
                else:
                    await asyncio.sleep(max(0.0, min(wake)))
        finally:
            await asyncio.gather(*(stop_task(run) for run in runs.values()))

    @staticmethod
    async def _run_duty(name: str, fn: Callable[[], Awaitable[object]], timeout_s: float) -> None:
        began = time.monotonic()
        bound = asyncio.timeout(timeout_s)
        try:
            async with bound:
                await fn()
        except Exception as exc:
            if not (isinstance(exc, TimeoutError) and bound.expired()):
                log_failure(log, exc, "leader duty %s failed", name)
                return
            log.error("leader duty %s cancelled after %.1f s: past its timeout of %.0f s (the other duties go on; "
                      "it runs again at its next interval)", name, time.monotonic() - began, timeout_s)
            TIMINGS.leader_duty_timeout(name)

    async def stop(self) -> None:
        """Stop campaigning and give the lease up at once (another process takes it next try)."""
        self._stopping = True
        for task in (self._task, self._duty_task):
            await stop_task(task)
        self._task = self._duty_task = None
        if self._held:  # (only where the holder is still this process)
            with contextlib.suppress(Exception):
                await self.repo.maintenance.release_lease(self.name, self.holder)
        self._held = False
