"""The leader's duties without PostgreSQL (a fake lease table): each run bounded by its duty's
timeout while the others go on, and fenced by the lease (cancelled when it is lost or its validity
passes, none started while not leading). tests/integration/test_leader.py has the real lease."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from run_engine.leader import LeaderLease, default_duty_timeout
from run_engine.timings import TIMINGS


class FakeLeases:
    """``repo.maintenance``'s lease calls: granted while ``held``; ``hang``: the next calls never answer."""

    def __init__(self) -> None:
        self.held = True
        self.hang = False
        self.calls = 0

    async def acquire_lease(self, name: str, holder: str, ttl_s: float) -> tuple[bool, float]:
        self.calls += 1
        if self.hang:
            await asyncio.Event().wait()
        return self.held, 0.0 if self.held else 0.05

    async def release_lease(self, name: str, holder: str) -> None:
        return None


def lease_over(leases: FakeLeases, *, ttl_s: float = 60.0, renew_s: float = 30.0) -> LeaderLease:
    return LeaderLease(SimpleNamespace(maintenance=leases), name="duties", ttl_s=ttl_s,  # type: ignore[arg-type]
                       renew_s=renew_s)


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


class Hanging:
    """A duty that never ends on its own (a statement behind a lock, a Redis call never answered)."""

    def __init__(self) -> None:
        self.started = 0
        self.cancelled = 0

    async def __call__(self) -> None:
        self.started += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


@pytest.fixture
def timeouts() -> Iterator[list[str]]:
    counted: list[str] = []
    TIMINGS.leader_duty_timeout = counted.append
    yield counted
    TIMINGS.reset()


def test_a_duty_is_bounded_by_ten_intervals_and_at_least_a_minute() -> None:
    assert default_duty_timeout(10) == 100
    assert default_duty_timeout(1) == 60


async def test_a_hung_duty_is_cancelled_after_its_timeout_and_the_others_go_on(
        timeouts: list[str], caplog: pytest.LogCaptureFixture) -> None:
    lease = lease_over(FakeLeases())
    hung = Hanging()
    ticks: list[bool] = []  # each: whether "hung" was under way then

    async def tick() -> None:
        ticks.append(hung.started > hung.cancelled)

    lease.add_duty("hung", 3600, hung, timeout_s=0.3)
    lease.add_duty("tick", 0.01, tick)
    caplog.set_level(logging.ERROR, logger="run_engine.leader")
    await lease.start()
    try:
        await until(lambda: hung.cancelled == 1, "the hung duty to be cancelled")
        assert any(ticks)  # before the fix the first duty's hang held every other duty
        seen = len(ticks)
        await until(lambda: len(ticks) >= seen + 3, "the other duty to go on")
        assert lease.is_leader and hung.started == 1  # (again at its next interval, an hour later)
    finally:
        await lease.stop()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("leader duty hung cancelled after "), errors
    assert timeouts == ["hung"]


async def test_losing_the_lease_cancels_the_duty_under_way_and_starts_none() -> None:
    leases = FakeLeases()
    lease = lease_over(leases, renew_s=0.02)
    long = Hanging()
    ticks: list[float] = []

    async def tick() -> None:
        ticks.append(time.monotonic())

    lease.add_duty("long", 3600, long)
    lease.add_duty("tick", 0.01, tick)
    await lease.start()
    try:
        await until(lambda: long.started == 1 and len(ticks) >= 2, "the duties to start")
        leases.held = False  # another process took it (this one was paused, or cut off)
        await until(lambda: long.cancelled == 1, "the duty under way to be cancelled")
        assert not lease.is_leader
        seen, calls = len(ticks), leases.calls
        await until(lambda: leases.calls >= calls + 5, "a few more tries at the lease")
        assert len(ticks) == seen and long.started == 1  # none started while another leads
    finally:
        await lease.stop()


async def test_a_duty_under_way_is_cancelled_once_the_lease_validity_passed_unrenewed() -> None:
    """A renewal that never answers (PostgreSQL cut off): the lease ends by this process's clock
    ``ttl_s`` after its last renewal was sent, and with it the duty under way."""
    leases = FakeLeases()
    lease = lease_over(leases, ttl_s=1.0, renew_s=0.05)
    long = Hanging()
    lease.add_duty("long", 3600, long)
    await lease.start()
    try:
        await until(lambda: long.started == 1, "the duty to start")
        leases.hang = True
        await until(lambda: long.cancelled == 1, "the duty under way to be cancelled")
        assert not lease.is_leader
    finally:
        await lease.stop()


async def test_no_duty_starts_while_another_process_leads() -> None:
    leases = FakeLeases()
    leases.held = False
    lease = lease_over(leases, renew_s=0.02)
    ran: list[Any] = []

    async def duty() -> None:
        ran.append(1)

    lease.add_duty("duty", 0.01, duty)
    await lease.start()
    try:
        await until(lambda: leases.calls >= 5, "a few tries at the lease")
        assert ran == [] and not lease.is_leader
        leases.held = True
        await until(lambda: bool(ran), "the duty once this process leads")
    finally:
        await lease.stop()
