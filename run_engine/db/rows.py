"""Rows as dataclasses: ``from_row(Environment, row)`` takes the columns the class names (a query
may return more); a column the class gives a default may be missing.

One spelling per id in the code: a row's field is named as the rest of the code names the id
(``env_id``, ``task_id``), whatever the column is called (``environment_id``, ``task_identifier``)."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")
#: field → column, where they differ
COLUMNS = {"env_id": "environment_id", "task_id": "task_identifier", "scoped_env_id": "scoped_environment_id"}
_FIELDS: dict[type[Any], tuple[tuple[str, str], ...]] = {}
_GETTERS: dict[type[Any], tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]]] = {}


def columns_of(cls: type[DataclassInstance]) -> tuple[tuple[str, str], ...]:
    """(field, column) of each field of a row class."""
    pairs = _FIELDS.get(cls)
    if pairs is None:
        pairs = _FIELDS[cls] = tuple((f.name, COLUMNS.get(f.name, f.name)) for f in dataclasses.fields(cls))
    return pairs


_ROW_GETTERS: dict[type[Any], Callable[[Mapping[str, Any]], tuple[Any, ...]]] = {}


def from_row(cls: type[T], row: Mapping[str, Any]) -> T:
    get = _ROW_GETTERS.get(cls)
    if get is None:
        pairs = columns_of(cls)
        if len(pairs) == 1:
            (_, column), = pairs
            get = _ROW_GETTERS[cls] = lambda r: (r[column],)
        else:
            get = _ROW_GETTERS[cls] = operator.itemgetter(*(c for _, c in pairs))
    try:
        return cls(*get(row))  # every column there: positional, the fields' order (the common case)
    except KeyError:  # a column the class gives a default is missing
        return cls(**{name: row[column] for name, column in columns_of(cls) if column in row})


def from_row_or_none(cls: type[T], row: Mapping[str, Any] | None) -> T | None:
    return None if row is None else from_row(cls, row)


def to_columns(obj: DataclassInstance) -> dict[str, Any]:
    """A row object as a JSON record keyed by column (the input of a jsonb_to_recordset insert);
    orjson writes its timestamps as ISO 8601 and its tuples as arrays."""
    getter = _GETTERS.get(type(obj))
    if getter is None:
        pairs = columns_of(type(obj))
        getter = _GETTERS[type(obj)] = (tuple(c for _, c in pairs), operator.attrgetter(*(n for n, _ in pairs)))
    columns, get = getter
    return dict(zip(columns, get(obj), strict=True))
