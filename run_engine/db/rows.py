"""Rows as dataclasses: ``from_row(Environment, row)`` takes the columns the class names (a query
may return more); a column the class gives a default may be missing.

One spelling per id in the code: a row's field is named as the rest of the code names the id
(``env_id``, ``task_id``), whatever the column is called (``environment_id``, ``task_identifier``)."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
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


def select_as(alias: str, cls: type[DataclassInstance], prefix: str) -> str:
    """SQL select list: ``alias.column AS "prefix.column"`` for each column of a row class. A
    statement that returns rows of several tables (a snapshot and its run) returns them as plain
    columns this way, read back by :func:`from_prefixed`: ``row_to_json`` of a 40-column row costs
    PostgreSQL five times the plain columns' output."""
    return ", ".join(f'{alias}.{column} AS "{prefix}.{column}"' for _, column in columns_of(cls))


_PREFIXED: dict[tuple[type[Any], str], tuple[str, Callable[[Mapping[str, Any]], tuple[Any, ...]]]] = {}


def from_prefixed(cls: type[T], row: Mapping[str, Any], prefix: str) -> T | None:
    """The row object a :func:`select_as` list returned, or ``None`` when its first column (the
    id) is NULL (the outer join found no row)."""
    found = _PREFIXED.get((cls, prefix))
    if found is None:
        names = [f"{prefix}.{column}" for _, column in columns_of(cls)]
        get: Callable[[Mapping[str, Any]], tuple[Any, ...]] = operator.itemgetter(*names)
        if len(names) == 1:
            get = lambda r: (r[names[0]],)  # noqa: E731 - itemgetter of one name answers a value, not a tuple
        found = _PREFIXED[(cls, prefix)] = (names[0], get)
    first, get = found
    return None if row[first] is None else cls(*get(row))


def from_slice(cls: type[T], row: Sequence[Any], start: int) -> T | None:
    """The row object a :func:`select_as` list returned at position ``start`` of a tuple row, or
    ``None`` when its first column (the id) is NULL."""
    if row[start] is None:
        return None
    n = _WIDTHS.get(cls)
    if n is None:
        n = _WIDTHS[cls] = len(columns_of(cls))
    return cls(*row[start:start + n])


_WIDTHS: dict[type[Any], int] = {}
