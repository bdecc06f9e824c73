from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

from run_engine.db.runs import RunRow
from run_engine.records import evolve, record


@record
class _One:
    only: int


def _run() -> RunRow:
    names = [f.name for f in dataclasses.fields(RunRow)]
    values = {name: f"{name}-value" for name in names}
    values.update(attempt_number=2, started_at=datetime(2026, 1, 2, tzinfo=UTC), tags=("a", "b"))
    return RunRow(**values)  # type: ignore[arg-type]


def test_evolve_is_dataclasses_replace_without_touching_the_original() -> None:
    run = _run()
    changes = {"status": "DEQUEUED", "attempt_number": 1, "started_at": None}
    copy = evolve(run, **changes)
    assert copy == dataclasses.replace(run, **changes) and copy is not run
    assert run.status == "status-value" and run.attempt_number == 2  # the original is as it was
    assert evolve(run) == run and evolve(run) is not run
    assert evolve(_One(1), only=2) == _One(2) and evolve(_One(1)) == _One(1)


@record
class _Checked:
    value: int

    def __post_init__(self) -> None:
        if self.value < 0:
            raise ValueError("negative")


@record
class _Derived:
    value: int
    double: int = dataclasses.field(init=False, default=0)


def test_evolve_refuses_a_record_whose_init_does_more_than_set_its_fields() -> None:
    import pytest

    for obj in (_Checked(1), _Derived(1)):
        with pytest.raises(TypeError, match="use dataclasses.replace"):
            evolve(obj, value=-1)
