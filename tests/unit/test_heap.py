"""After start-up a process moves what it made out of the garbage collector's reach, so that
its full collections walk only what serving makes (run_engine/heap.py)."""

from __future__ import annotations

import gc
import weakref

from run_engine import heap


class _Kept:
    pass


def test_settle_collects_then_freezes_what_start_up_made() -> None:
    kept = _Kept()
    garbage = _Kept()
    garbage.cycle = garbage  # type: ignore[attr-defined]  # start-up garbage: a cycle nothing else holds
    gone = weakref.ref(garbage)
    del garbage
    try:
        frozen = heap.settle()
        assert gone() is None  # collected before the freeze, not frozen for good
        assert frozen > 0 and gc.get_freeze_count() == frozen
        assert not any(o is kept for o in gc.get_objects())  # out of the collector's reach
        made_later = _Kept()
        assert any(o is made_later for o in gc.get_objects())  # what serving makes is collected as usual
    finally:
        gc.unfreeze()


def test_tune_makes_young_collections_rarer_and_zero_leaves_the_collector_alone() -> None:
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        heap.tune()
        assert gc.get_threshold() == (heap.DEFAULT_THRESHOLD, 10, 10)  # the older generations as they were
        heap.tune(0)
        assert gc.get_threshold() == (heap.DEFAULT_THRESHOLD, 10, 10)
        heap.tune(2_500)
        assert gc.get_threshold() == (2_500, 10, 10)
    finally:
        gc.set_threshold(*before)
