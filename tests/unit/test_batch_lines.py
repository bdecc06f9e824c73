"""The lines of a streamed batch read one by one (run_engine/api/batch_lines.py): which item a bad
line is, when it is one, and when the body is refused whole."""

from __future__ import annotations

import orjson
import pytest

from run_engine.api.batch_lines import read_lines
from run_engine.api.http import ApiError


def good(index: int) -> bytes:
    return orjson.dumps({"index": index, "task": "hello", "payload": {"index": 9}})


@pytest.mark.parametrize(("bad", "named"), [
    (b'{"index": 2, "task": "hello", "payload": {"a"', (2, "hello")),  # cut short: its opening names it
    (b'  { "index" : 2 }x', (2, None)),
    (b'{"index": 2, "task": 7}', (2, None)),  # decoded, a bad shape: its index names it
    (b'{"index": [2], "task": "hello"}', (None, None)),  # not an index
    (b'{"index": 2.5, "task": "hello",', (None, None)),
    (b'{"index": 02, "task": "hello",', (None, None)),
    (b'{"payload": {"index": 2}, "index": 2,', (None, None)),  # only the first key is read
    (b'{"index": 5, "task": "hello", "payload": 1}', (None, None)),  # not an index of the batch
    (b'{"index": 2, "task": "a\\u0000b", "payload": 1}', (2, None)),  # stored with its batch: no NUL
])
def test_a_bad_line_is_the_item_it_names_if_any(bad: bytes, named: tuple[int | None, str | None]) -> None:
    lines = read_lines(b"\n".join([good(0), bad, b"", good(1)]), 4)
    assert [(n, item.index) for n, item in lines.items] == [(1, 0), (4, 1)]
    (error,) = lines.errors
    assert (error.line, error.index, error.task) == (2, *named)
    assert error.message.startswith("line 2")


def test_a_body_of_no_items_or_of_too_many_lines_is_refused_whole() -> None:
    for body in (b"{nope", b"not ndjson at all\n[]", b'{"index": 9, "task": "hello"}'):
        with pytest.raises(ApiError) as refused:
            read_lines(body, 4)
        assert refused.value.status == 400 and refused.value.message.startswith("line 1: ")
    with pytest.raises(ApiError, match="more items than the batch's runCount 2"):
        read_lines(b"\n".join([good(0), b"{", good(1)]), 2)
    assert read_lines(b"\n\n", 2).items == [] and read_lines(b"", 2).errors == []
    only_failed = read_lines(b'{"index": 1, "task": ""}', 2)  # an item, if a failed one: not refused whole
    assert only_failed.items == [] and only_failed.errors[0].index == 1
