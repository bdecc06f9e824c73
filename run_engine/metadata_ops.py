"""Changes of a run's metadata by operations (Trigger.dev's ``metadata.set/del/append/remove/
increment/decrement/update`` and their ``metadata.parent.*`` / ``metadata.root.*``), applied to the
metadata as it is under the run's row lock (``RunRepository.change_metadata``), so that two tasks
incrementing one counter lose neither increment.

What an operation does (as Trigger.dev's ``applyMetadataOperations``, where it is defined):

* ``set`` key value: the key's value; a key starting with ``$.`` is a path (``$.progress.done``,
  ``$.items.0``: a component of digits indexes a list) whose containers must exist: a path through
  a missing, ``null`` or scalar value changes nothing; an index one past a list's end appends;
* ``delete`` key: removes the top-level key (a ``$.`` key too, literally, as Trigger.dev does);
* ``append`` key value: onto the key's list; a missing key becomes ``[value]``, any other value
  ``[value before, value]``;
* ``remove`` key value: every item of the key's list equal to ``value`` (JSON equality: ``true``
  is not ``1``); nothing when the key holds no list;
* ``increment`` key number: the key's number plus it (a key holding no number counts as 0;
  ``decrement`` is a negative increment);
* ``update`` object: the whole metadata replaced by it.

An operation that changes nothing is not an error (Trigger.dev leaves it unapplied); only what
cannot be applied sensibly is (:class:`~run_engine.errors.ValidationError`, naming the operation):
an index past a list's end, a number that stops being finite, metadata nested too deep, removes
that compare too many items in one request.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from run_engine.errors import ValidationError
from run_engine.records import record

TYPES = ("set", "delete", "append", "remove", "increment", "update")
#: the most operations one request carries (operations, parentOperations and rootOperations together)
MAX_OPERATIONS = 1_000
#: the longest key (a path too)
MAX_KEY_CHARS = 1_024
#: the deepest metadata may be nested (as any stored value: run_engine.api.inputs.MAX_DEPTH)
MAX_DEPTH = 100
#: list items the ``remove`` operations of one request compare at most (each a C-speed ``==``):
#: 1,000 removes over a 100,000-item list would otherwise hold the event loop, and the run's row
#: lock, for seconds
MAX_REMOVE_COMPARISONS = 1_000_000
#: the largest integer JSON carries as an integer here (orjson's 64-bit); past it a sum is a float
_MAX_INT = 2**63 - 1


@record
class MetadataOp:
    """One operation. ``at``: where the request had it (``operations.3``), for errors."""

    type: str
    key: str | None
    value: Any
    at: str
    path: tuple[str, ...] | None = None  # the components of a ``$.`` key (set/append/remove/increment)


def parse_op(raw: Any, at: str) -> MetadataOp:
    """An operation from its JSON, or :class:`ValidationError` naming ``at`` and the field."""
    if not isinstance(raw, dict):
        raise ValidationError(at, "must be an object {type, key?, value?}")
    kind = raw.get("type")
    if kind not in TYPES:
        raise ValidationError(f"{at}.type", f"must be one of {', '.join(TYPES)}")
    if kind == "update":
        value = raw.get("value")
        if not isinstance(value, dict):
            raise ValidationError(f"{at}.value", "must be an object (the whole metadata)")
        return MetadataOp("update", None, value, at)
    key = raw.get("key")
    if not isinstance(key, str):
        raise ValidationError(f"{at}.key", "a string is required")
    if len(key) > MAX_KEY_CHARS:
        raise ValidationError(f"{at}.key", f"at most {MAX_KEY_CHARS} characters")
    if kind == "delete":
        return MetadataOp("delete", key, None, at)
    if "value" not in raw:
        raise ValidationError(f"{at}.value", "is required")
    value = raw["value"]
    if kind == "increment" and (isinstance(value, bool) or not isinstance(value, int | float)
                                or not _finite(value)):
        raise ValidationError(f"{at}.value", "must be a number")
    return MetadataOp(kind, key, value, at, parse_path(key, at) if key.startswith("$.") else None)


def parse_path(key: str, at: str) -> tuple[str, ...]:
    """The components of a ``$.a.b.0`` key (``\\.`` is a dot inside a name, ``\\\\`` a backslash).
    Wildcards, slices and filters of JSONPath are refused: a path names one place."""
    text = key[2:]
    parts = text.split(".") if "\\" not in text else _unescaped(text)
    if any(p == "" for p in parts):
        raise ValidationError(f"{at}.key", "a path's names must not be empty ($.a.b, not $..a or $.a.)")
    if any(p == "*" or p.startswith("[") for p in parts):
        raise ValidationError(f"{at}.key", "wildcards, slices and filters are not supported: a path names one "
                                           "place ($.a.b, $.items.0)")
    if len(parts) > MAX_DEPTH:
        raise ValidationError(f"{at}.key", f"a path of at most {MAX_DEPTH} names")
    return tuple(parts)


def _unescaped(text: str) -> list[str]:
    """A path's names split at each dot that is not escaped."""
    parts: list[str] = []
    name: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text) and text[i + 1] in ".\\":
            name.append(text[i + 1])
            i += 2
            continue
        if ch == ".":
            parts.append("".join(name))
            name = []
        else:
            name.append(ch)
        i += 1
    parts.append("".join(name))
    return parts


class Budget:
    """What the ``remove`` operations of one request may still compare."""

    __slots__ = ("left",)

    def __init__(self, left: int = MAX_REMOVE_COMPARISONS) -> None:
        self.left = left


def apply(metadata: Any, ops: Sequence[MetadataOp], budget: Budget) -> tuple[dict[str, Any], bool]:
    """The metadata after ``ops`` (``metadata`` itself, changed in place, when it is an object) and
    whether any operation changed it."""
    current: dict[str, Any] = metadata if isinstance(metadata, dict) else {}
    changed = False
    for op in ops:
        if op.type == "update":
            current = op.value
            changed = True
            continue
        assert op.key is not None
        if op.path is None:
            holder: Any = current
            name: Any = op.key
        else:
            found = _parent(current, op.path)
            if found is None:
                continue  # a path through what is missing or not a container: nothing to change
            holder, name = found
            if isinstance(holder, list) and name > len(holder):
                raise ValidationError(f"{op.at}.key", f"index {name} is past the end of the list "
                                                      f"({len(holder)} items)")
        changed |= _apply_one(op, holder, name, budget)
    return current, changed


def _parent(root: dict[str, Any], path: tuple[str, ...]) -> tuple[Any, Any] | None:
    """The container that holds the path's last name, and that name (an int for a list), or None."""
    node: Any = root
    for step in path[:-1]:
        if isinstance(node, dict):
            node = node.get(step)
        elif isinstance(node, list) and _index(step) and int(step) < len(node):
            node = node[int(step)]
        else:
            return None
    last = path[-1]
    if isinstance(node, dict):
        return node, last
    if isinstance(node, list) and _index(last):
        return node, int(last)
    return None


def _finite(value: int | float) -> bool:
    """Whether ``value`` is a finite number a double holds (an integer past its range is not:
    ``math.isfinite`` raises OverflowError for it)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _index(name: str) -> bool:
    return name.isascii() and name.isdigit()


def _apply_one(op: MetadataOp, holder: Any, name: Any, budget: Budget) -> bool:
    """Apply one key operation at ``holder[name]`` (a dict's key, or a list's index ≤ its length)."""
    missing = name >= len(holder) if isinstance(holder, list) else name not in holder
    before = None if missing else holder[name]

    def put(value: Any) -> None:
        if isinstance(holder, list) and name == len(holder):
            holder.append(value)
        else:
            holder[name] = value

    if op.type == "set":
        put(op.value)
        return True
    if op.type == "delete":  # top-level keys only (Trigger.dev's), a "$." key literally
        if missing:
            return False
        del holder[name]
        return True
    if op.type == "append":
        if isinstance(before, list):
            before.append(op.value)
        else:
            put([op.value] if missing else [before, op.value])
        return True
    if op.type == "remove":
        if not isinstance(before, list):
            return False
        budget.left -= len(before)
        if budget.left < 0:
            raise ValidationError(op.at, f"the removes of one request compare at most {MAX_REMOVE_COMPARISONS} "
                                         "list items")
        value = op.value  # == at C speed for each item; the strict look only at those it matches
        kept = [item for item in before if not (item == value and _strict(item, value))]
        if len(kept) == len(before):
            return False
        put(kept)
        return True
    # increment
    base = before if isinstance(before, int | float) and not isinstance(before, bool) else 0
    total = base + op.value
    if isinstance(total, int) and abs(total) > _MAX_INT:
        total = float(total) if _finite(total) else math.inf
    if isinstance(total, float) and not math.isfinite(total):
        raise ValidationError(f"{op.at}.value", "the sum is not a finite number")
    put(total)
    return True


def same_json(a: Any, b: Any) -> bool:
    """JSON equality: Python's ``==`` (C speed) but ``true`` is not ``1`` (as in JavaScript)."""
    return bool(a == b) and _strict(a, b)


def _strict(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b)
    if isinstance(a, dict):
        return all(_strict(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return all(_strict(x, y) for x, y in zip(a, b, strict=True))
    return True


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``value`` nests objects and arrays more than ``limit`` levels deep."""
    if not isinstance(value, dict | list):
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False
