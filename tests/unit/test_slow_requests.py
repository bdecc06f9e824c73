"""The guard on requests that stop arriving (run_engine/api/slow_requests.py), on a fake clock."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from run_engine.api.slow_requests import ANSWER_408, SlowRequests


@dataclass
class Transport:
    written: list[bytes] = field(default_factory=list)
    closed: bool = False
    aborted: bool = False

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True


@dataclass
class Flow:
    read_paused: bool = False


@dataclass
class Protocol:
    transport: Transport = field(default_factory=Transport)
    flow: Flow = field(default_factory=Flow)
    cycle: Any = None

    def __hash__(self) -> int:
        return id(self)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def guard() -> tuple[SlowRequests, Clock]:
    clock = Clock()
    return SlowRequests(head_s=30, body_idle_s=60, body_s=600, check_s=5, clock=clock), clock


def test_a_connection_that_sends_nothing_is_answered_408_and_closed() -> None:
    slow, clock = guard()
    silent, talking = Protocol(), Protocol()
    slow.head_begins(silent)
    slow.head_begins(talking)
    clock.now += 20
    slow.head_begins(talking)  # its first byte: the head still counts from the connection's start
    slow.body_begins(talking)
    clock.now += 10
    assert slow.sweep() == [silent]
    assert silent.transport.written == [ANSWER_408] and silent.transport.closed
    assert not talking.transport.is_closing() and len(slow) == 1


def test_a_body_that_stops_is_cut_and_one_that_trickles_past_its_whole_time_too() -> None:
    slow, clock = guard()
    stops, trickles, unread = Protocol(), Protocol(), Protocol()
    for p in (stops, trickles, unread):
        slow.head_begins(p)
        slow.body_begins(p)
    unread.flow.read_paused = True  # the application has not read what came: not the client's fault
    for _ in range(11):
        clock.now += 55
        slow.body_arrives(trickles)
        cut = slow.sweep()
        if stops in cut:
            break
    assert stops.transport.aborted and not stops.transport.written and not trickles.transport.is_closing()
    while not trickles.transport.is_closing():
        clock.now += 55
        slow.body_arrives(trickles)
        slow.sweep()
    assert clock.now - 1000.0 >= 600 and trickles.transport.aborted
    assert not unread.transport.is_closing()


def test_a_request_that_arrived_is_not_watched() -> None:
    slow, clock = guard()
    p = Protocol()
    slow.head_begins(p)
    slow.body_begins(p)
    slow.done(p)
    clock.now += 10_000
    assert slow.sweep() == [] and len(slow) == 0


def test_a_head_late_behind_an_answer_being_written_is_closed_without_a_408() -> None:
    """A pipelined request's head, its connection still answering the one before: no 408 in the
    middle of that answer."""
    slow, clock = guard()
    p = Protocol(cycle=type("Cycle", (), {"response_complete": False})())
    slow.head_begins(p)
    clock.now += 31
    assert slow.sweep() == [p] and p.transport.closed and not p.transport.written
