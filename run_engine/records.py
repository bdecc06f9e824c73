"""``@record``: the dataclass of what the engine builds several of per run (rows, transitions,
queue items, events).

Frozen for the type checker (an assignment to a field is an error), a plain slots dataclass at run
time, hashable as a frozen one. A frozen dataclass's ``__init__`` sets every field through
``object.__setattr__``: 12x slower for ``RunRow``'s 36 fields (4.4 against 0.35 us), which made
the in-process lifecycle ~12 % slower (docs/BENCHMARKS.md)."""

from __future__ import annotations

import dataclasses
from typing import TypeVar, dataclass_transform

C = TypeVar("C", bound=type)


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def record(cls: C) -> C:
    return dataclasses.dataclass(slots=True, unsafe_hash=True)(cls)  # type: ignore[return-value]
