"""The guard that cuts connections whose answers are not read (run_engine/api/stalls.py), with
transports whose unsent bytes the test sets and a clock it moves."""

from __future__ import annotations

from run_engine.api.stalls import StallGuard


class Transport:
    def __init__(self, unsent: int) -> None:
        self.unsent = unsent
        self.aborted = False
        self.closed = False

    def get_write_buffer_size(self) -> int:
        return self.unsent

    def get_extra_info(self, name: str) -> None:
        return None  # no socket: only the buffer counts

    def is_closing(self) -> bool:
        return self.aborted or self.closed

    def abort(self) -> None:
        self.aborted = True
        self.unsent = 0


def guard() -> tuple[StallGuard, list[float]]:
    now = [0.0]
    return StallGuard(stall_s=30, check_s=5, per_key=2, clock=lambda: now[0]), now


def test_a_client_that_reads_however_slowly_is_never_cut() -> None:
    g, now = guard()
    t = Transport(8_000_000)
    g.watch(t, "env:a")
    for _ in range(30):  # five minutes, a few bytes out every check
        now[0] += 10
        t.unsent -= 1000
        assert g.sweep() == []
    assert not t.aborted


def test_a_connection_whose_answer_stopped_going_out_is_cut_after_the_stall_time() -> None:
    g, now = guard()
    t = Transport(8_000_000)
    g.watch(t, None)  # whatever its key: a worker's, an unauthenticated one
    now[0] += 29
    assert g.sweep() == []
    now[0] += 1
    assert g.sweep() == [t] and t.aborted and len(g) == 0


def test_one_environment_keeps_only_its_share_of_stalled_connections() -> None:
    g, now = guard()
    theirs = [Transport(8_000_000) for _ in range(5)]
    for i, t in enumerate(theirs):
        now[0] = i * 0.1
        g.watch(t, "env:noisy")
    others = [Transport(8_000_000) for _ in range(2)]
    for t in others:
        g.watch(t, "env:quiet")
    now[0] += 5
    cut = g.sweep()
    assert cut == theirs[:3]  # stalled the longest; two are kept, as another tenant's two
    assert [t.aborted for t in theirs] == [True, True, True, False, False]
    assert not any(t.aborted for t in others)


def test_a_connection_that_drained_or_closed_is_forgotten() -> None:
    g, now = guard()
    drained, closed = Transport(100_000), Transport(100_000)
    g.watch(drained, "env:a")
    g.watch(closed, "env:a")
    g.unwatch(drained)  # below the low-water mark again
    closed.abort()  # the client went away
    now[0] += 60
    assert g.sweep() == [] and len(g) == 0


def test_a_connection_closed_with_its_answer_unsent_is_still_cut() -> None:
    """A close flushes first: an answer sent with `connection: close`, or a keep-alive connection
    closed for idleness, still holds its unsent bytes until they go out."""
    g, now = guard()
    t = Transport(8_000_000)
    g.watch(t, "env:a")
    t.closed = True
    now[0] += 30
    assert g.sweep() == [t] and t.aborted


def test_a_guard_whose_loop_closed_with_its_check_pending_checks_on_the_next_loop() -> None:
    """The guard is one per process; a loop that closed with its check still to come (a server
    stopped, a test's loop) left a timer that would never fire, and no check was set again."""
    import asyncio
    import time

    g = StallGuard(stall_s=0.05, check_s=0.01)

    async def watch_and_leave() -> None:
        g.watch(Transport(1000), None)  # its check is set on this loop, which then closes

    async def watch_until_cut() -> None:
        t = Transport(1000)
        g.watch(t, None)
        deadline = time.monotonic() + 10
        while not t.aborted:
            assert time.monotonic() < deadline, "never checked"
            await asyncio.sleep(0.01)

    asyncio.run(watch_and_leave())
    asyncio.run(watch_until_cut())
