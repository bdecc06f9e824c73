"""After start-up a process moves what it made out of the garbage collector's reach, so that
its full collections walk only what serving makes (run_engine/heap.py)."""

from __future__ import annotations

import gc

from run_engine import heap


class _Kept:
    pass


def test_settle_collects_then_freezes_what_start_up_made() -> None:
    kept = _Kept()
    cycle: list[object] = []
    cycle.append(cycle)  # start-up garbage: collected, not frozen for good
    del cycle
    try:
        frozen = heap.settle()
        assert frozen > 0 and gc.get_freeze_count() == frozen
        tracked = gc.get_objects()
        assert not any(o is kept for o in tracked)  # out of the collector's reach
        assert gc.collect() == 0  # the cycle went in settle's collection
        made_later = _Kept()
        assert any(o is made_later for o in gc.get_objects())  # what serving makes is collected as usual
    finally:
        gc.unfreeze()
