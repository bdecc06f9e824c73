"""A batch wait's journal entry names its runs; an entry without them (written before waits of
kind batch were checked) reads as a batch of none instead of failing every read of the journal."""

from __future__ import annotations

from typing import Any

import pytest

from systems.waitpoints import batch_runs, is_batch_entry


@pytest.mark.parametrize(("result", "runs"), [
    ({"runIds": ["run_a", "run_b"]}, ["run_a", "run_b"]),
    (None, []), ({}, []), ({"runIds": None}, []), ({"runIds": "run_a"}, []), ([1, 2], []),
    ({"runIds": ["run_a", 7, None]}, ["run_a"]),
])
def test_the_runs_of_a_batch_entry(result: Any, runs: list[str]) -> None:
    assert batch_runs(result) == runs
    assert is_batch_entry(result) == (isinstance(result, dict) and isinstance(result.get("runIds"), list))
