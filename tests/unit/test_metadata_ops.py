"""What each metadata operation does to a value (run_engine/metadata_ops.py), without a database:
paths and their escapes, JSON equality, and the bounds of what operations make."""

from __future__ import annotations

from typing import Any

import pytest

from run_engine.errors import ValidationError
from run_engine.metadata_ops import Budget, apply, parse_op, parse_path, same_json, too_deep


def applied(metadata: Any, *ops: dict[str, Any], budget: Budget | None = None) -> tuple[Any, bool]:
    return apply(metadata, [parse_op(op, f"operations.{i}") for i, op in enumerate(ops)], budget or Budget())


def test_paths_split_at_dots_that_are_not_escaped() -> None:
    assert parse_path("$.a.b.0", "x") == ("a", "b", "0")
    assert parse_path("$.a\\.b.c", "x") == ("a.b", "c")
    assert parse_path("$.a\\\\.b", "x") == ("a\\", "b")
    for bad in ("$.", "$..a", "$.a.", "$.a.*", "$.a.[0:1]", "$." + ".".join("a" * 101)):
        with pytest.raises(ValidationError):
            parse_path(bad, "x")


def test_json_equality_tells_true_from_one() -> None:
    assert same_json(1, 1.0) and same_json({"a": [1, {"b": None}]}, {"a": [1.0, {"b": None}]})
    assert not same_json(True, 1) and not same_json([1, True], [1, 1]) and not same_json({"a": 0}, {"a": False})


def test_a_path_never_makes_containers_and_digits_index_lists_only() -> None:
    md = {"d": {"0": "zero"}, "l": [{"x": 1}], "n": None}
    got, changed = applied(md, {"type": "set", "key": "$.d.0", "value": "set"},
                           {"type": "set", "key": "$.l.0.x", "value": 2},
                           {"type": "set", "key": "$.n.x", "value": 1},
                           {"type": "set", "key": "$.l.x", "value": 1},
                           {"type": "append", "key": "$.nope.x", "value": 1})
    assert changed and got == {"d": {"0": "set"}, "l": [{"x": 2}], "n": None}


def test_nothing_changed_is_reported_so() -> None:
    assert applied({"a": 1}, {"type": "delete", "key": "b"}, {"type": "remove", "key": "a", "value": 1}) == \
        ({"a": 1}, False)


def test_the_removes_of_a_request_share_one_budget() -> None:
    budget = Budget(10)
    applied({"l": [1, 2, 3, 4, 5]}, {"type": "remove", "key": "l", "value": 9}, budget=budget)
    with pytest.raises(ValidationError, match="operations.0"):
        applied({"l": [1, 2, 3, 4, 5, 6]}, {"type": "remove", "key": "l", "value": 9}, budget=budget)


def test_depth() -> None:
    deep: Any = 1
    for _ in range(100):
        deep = [deep]
    assert not too_deep(deep) and too_deep([deep]) and not too_deep("flat")


def test_an_increment_by_an_integer_no_float_holds_is_refused() -> None:
    """An integer past a double's range (the SDK takes Python's ints as they are) is refused naming
    the operation, as a sum that is not finite is, not an OverflowError out of float()."""
    with pytest.raises(ValidationError, match="operations.0.value"):
        applied({}, {"type": "increment", "key": "n", "value": 10**400})
    with pytest.raises(ValidationError, match="operations.1.value"):
        applied({}, {"type": "increment", "key": "n", "value": 1}, {"type": "increment", "key": "n", "value": -10**400})
