"""Rows as dataclasses: ``from_row(Environment, row)`` takes the columns the class names (a query
may return more); a column the class gives a default may be missing."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")
_FIELDS: dict[type[Any], tuple[str, ...]] = {}


def from_row(cls: type[T], row: Mapping[str, Any]) -> T:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return cls(**{name: row[name] for name in names if name in row})


def from_row_or_none(cls: type[T], row: Mapping[str, Any] | None) -> T | None:
    return None if row is None else from_row(cls, row)


def jsonable(value: Any) -> Any:
    """A value as JSON has it in a jsonb_to_recordset input (timestamps as ISO text, tuples as arrays)."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, tuple):
        return list(value)
    return value
