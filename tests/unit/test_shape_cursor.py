"""The shape stream's cursor (run_engine.api.shape_stream): answers cut anywhere, late commits and
a window sent again in parts never lose a run, and every answer moves the client on."""

from __future__ import annotations

import dataclasses
import random
from datetime import UTC, datetime, timedelta

import pytest

from run_engine.api.http import ApiError
from run_engine.api.shape_stream import ALL, GRACE_US, START, Cursor, advance, parse_offset, unsent
from run_engine.db.runs import RunRow

T0 = datetime(2026, 11, 27, 12, tzinfo=UTC)


def run(run_id: str, at_ms: int) -> RunRow:
    values = {f.name: None for f in dataclasses.fields(RunRow)}
    values.update(id=f"run_{run_id}", created_at=T0, updated_at=T0 + timedelta(milliseconds=at_ms))
    return RunRow(**values)  # type: ignore[arg-type]


def answer(runs: list[RunRow], cursor: Cursor, room: int) -> tuple[list[RunRow], Cursor, bool]:
    """One answer that holds ``room`` runs, and the cursor it gives (round-tripped as an offset)."""
    pending, again = unsent(runs, cursor)
    sent = min(room, len(pending))
    after = advance(cursor, runs, pending, again, sent)
    assert parse_offset(after.offset()) == after
    return pending[:sent], after, sent == len(pending)


def test_an_initial_sync_in_parts_sends_every_run_once_in_order_of_change() -> None:
    runs = [run(f"r{i:02}", at_ms=i // 3) for i in range(20)]  # three runs per millisecond
    random.Random(1).shuffle(runs)
    cursor, got, complete = START, [], False
    while not complete:
        sent, cursor, complete = answer(runs, cursor, room=4)
        got += [r.id for r in sent]
        assert cursor.at[1] == ALL or cursor.at[1] == got[-1]  # a cut answer names its last run
    assert got == [f"run_r{i:02}" for i in range(20)]
    assert unsent(runs, cursor) == ([], 0)  # nothing left: a live request waits


def test_a_late_commit_before_the_cursor_is_sent_with_its_window_again_in_parts() -> None:
    runs = [run(f"a{i}", at_ms=1000 + i) for i in range(10)]
    _, cursor, complete = answer(runs, START, room=100)
    assert complete and cursor.at == (int((T0 + timedelta(milliseconds=1009)).timestamp() * 1e6), ALL)
    late = run("late", at_ms=1005)  # began before the newest change sent, committed after it
    runs.append(late)
    got: list[str] = []
    for _ in range(10):
        sent, cursor, complete = answer(runs, cursor, room=3)
        got += [r.id for r in sent]
        if complete:
            break
        assert cursor.resend is not None  # the window in parts: its place is in the offset
    assert complete and late.id in got and sorted(got) == sorted(r.id for r in runs)
    assert unsent(runs, cursor) == ([], 0)


def test_a_window_that_changes_during_its_resend_starts_over_and_still_ends() -> None:
    runs = [run(f"a{i}", at_ms=1000 + i) for i in range(10)]
    _, cursor, _ = answer(runs, START, room=100)
    runs.append(run("late", at_ms=1005))
    sent, cursor, complete = answer(runs, cursor, room=3)
    assert not complete and cursor.resend is not None
    runs = [dataclasses.replace(r, updated_at=T0 + timedelta(seconds=9)) if r.id == "run_a8" else r
            for r in runs]  # one run of the window changed again: it leaves it, the window starts over
    pending, again = unsent(runs, cursor)
    assert again == 10 and pending[-1].id == "run_a8"
    steps = 0
    while not complete:
        _, cursor, complete = answer(runs, cursor, room=3)
        steps += 1
        assert steps < 10


def test_runs_changed_after_the_cursor_come_after_it_and_in_the_same_microsecond_too() -> None:
    runs = [run(f"b{i}", at_ms=0) for i in range(6)]  # one transaction: one updated_at
    sent, cursor, _ = answer(runs, START, room=2)
    assert [r.id for r in sent] == ["run_b0", "run_b1"] and cursor.at[1] == "run_b1"
    runs.append(run("b0x", at_ms=0))  # a late commit in that microsecond, before the cursor's id
    runs.append(run("b9", at_ms=0))  # and one after it
    got = [r.id for r in sent]
    complete = False
    while not complete:
        sent, cursor, complete = answer(runs, cursor, room=2)
        got += [r.id for r in sent]
    assert set(got) == {r.id for r in runs}


def test_a_window_older_than_grace_is_not_checked_again() -> None:
    runs = [run("old", at_ms=0), run("new", at_ms=GRACE_US // 1000 + 10)]
    _, cursor, _ = answer(runs, START, room=10)
    assert unsent([run("old", at_ms=0)] + runs[1:], cursor) == ([], 0)


@pytest.mark.parametrize("offset", ["", "1", "1_2_3_4", "a_1", "1_a", "-1_2", "1_2_", "1_2_UP", "1_2_~",
                                    "1_2_~_3_~", "1_2_x_3", "1_2_x_y_z", "1" * 21 + "_1",
                                    "1_2_" + "a" * 200, "1_2_run_x"])
def test_an_offset_this_server_never_answered_with_is_refused(offset: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse_offset(offset)
    assert refused.value.status == 400


def test_offsets_round_trip() -> None:
    for cursor in (Cursor((5, ALL), 7), Cursor((5, "run_abc"), 7), Cursor((5, ALL), 7, (4, "run_x2")),
                   Cursor((5, "run_abc"), 0, (3, "run_q"))):
        assert parse_offset(cursor.offset()) == cursor
    assert Cursor((5, ALL), 7).offset() == "5_7"  # what clients of the earlier server hold
