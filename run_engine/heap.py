"""Keep the garbage collector's full collections short in long-running processes.

A full (generation 2) collection walks every object the collector tracks. Right after start-up
that is everything start-up made and will keep for good: modules, classes, the app, pools,
scripts (~90,000 objects in the API server). Walking them took 36-134 ms in the server, a pause
every request waiting at that moment paid (the trigger→start p99 at half load went from ~15 ms to
~50-130 ms when one fell in the measured phase). :func:`settle` collects once and moves what is
left out of the collector's reach (``gc.freeze``): later full collections walk only what serving
made (~3,600 objects, 2-3 ms).

:func:`tune` makes the young collections rarer. At CPython's default (a collection of the youngest
generation every 700 net allocations of tracked objects) a process holding a few hundred runs in
flight walked them again and again: 334 young and 31 middle collections for 8,000 runs in
``bench/lifecycle.py``, 11-13 % of the engine's CPU. At 10,000 it is a handful, and each young
collection walks at most ~10,000 objects (well under a millisecond).
"""

from __future__ import annotations

import gc

#: the youngest generation's threshold (``gc.set_threshold``'s first value; CPython's is 700)
DEFAULT_THRESHOLD = 10_000


def settle() -> int:
    """Collect, then freeze every object that survived (start-up is over); the number frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def tune(threshold: int = DEFAULT_THRESHOLD) -> None:
    """Collect the youngest generation every ``threshold`` net allocations (0: leave it as it is);
    the older generations keep their thresholds (collected every 10 younger collections)."""
    if threshold > 0:
        gc.set_threshold(threshold, *gc.get_threshold()[1:])
