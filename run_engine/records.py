"""``@record``: the dataclass of what the engine builds several of per run (rows, transitions,
queue items, events).

Frozen for the type checker (an assignment to a field is an error), a plain slots dataclass at run
time, hashable as a frozen one. A frozen dataclass's ``__init__`` sets every field through
``object.__setattr__``: 12x slower for ``RunRow``'s 36 fields (4.4 against 0.35 us), which made
the in-process lifecycle ~12 % slower (docs/BENCHMARKS.md)."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any, TypeVar, dataclass_transform

C = TypeVar("C", bound=type)
R = TypeVar("R")


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def record(cls: C) -> C:
    return dataclasses.dataclass(slots=True, unsafe_hash=True)(cls)  # type: ignore[return-value]


_COPIERS: dict[type, Callable[[Any], tuple[Any, ...]]] = {}


def evolve(obj: R, **changes: Any) -> R:
    """``dataclasses.replace`` for a record: a copy of ``obj`` with ``changes``, built from all its
    fields read at once instead of through replace's walk of every field's metadata (2.5 against
    5.8 us for ``RunRow``). Every field of a record is an ``__init__`` argument, in order; a class
    with a ``__post_init__`` or a field outside ``__init__`` is refused (the changes would bypass it):
    use ``dataclasses.replace`` for it."""
    cls = type(obj)
    get = _COPIERS.get(cls)
    if get is None:
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        if hasattr(cls, "__post_init__") or not all(f.init for f in fields):
            raise TypeError(f"evolve() cannot copy a {cls.__name__}: it has a __post_init__ or a field "
                            "outside __init__; use dataclasses.replace")
        names = [f.name for f in fields]
        get = _COPIERS[cls] = operator.attrgetter(*names, *names[:1])  # a tuple even for one field
    new = cls(*get(obj)[:-1])
    for name, value in changes.items():
        object.__setattr__(new, name, value)
    return new
