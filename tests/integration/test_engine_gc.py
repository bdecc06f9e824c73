"""An engine sets its process's young garbage collections to ``gc_threshold`` when it is made
(run_engine/heap.py); 0 leaves the process's own."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any


async def test_an_engine_sets_the_collectors_threshold_it_is_given(make_engine: Callable[..., Any]) -> None:
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        await make_engine(gc_threshold=0)
        assert gc.get_threshold() == (700, 10, 10)  # the host's own
        await make_engine()
        assert gc.get_threshold() == (10_000, 10, 10)
        await make_engine(gc_threshold=3_000)
        assert gc.get_threshold() == (3_000, 10, 10)
    finally:
        gc.set_threshold(*before)
