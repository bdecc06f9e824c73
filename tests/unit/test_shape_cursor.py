"""The shape stream's cursor (run_engine.api.shape_stream): answers cut anywhere, late commits and
late commits sent again in parts never lose a run, a run that merely changed again resends nothing,
and every answer moves the client on."""

from __future__ import annotations

import dataclasses
import random
from datetime import UTC, datetime, timedelta

import pytest

from run_engine.api.http import ApiError
from run_engine.api.shape_stream import ALL, GRACE_US, START, Cursor, Refetch, advance, parse_offset, unsent
from run_engine.db.runs import RunRow, ShapeRead

T0 = datetime(2026, 11, 27, 12, tzinfo=UTC)


class Db:
    """Runs as a table would hold them: each row written by a transaction (its xmin), and the oldest
    transaction still running at a read (every one committed, unless ``running`` says otherwise)."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[RunRow, int]] = {}
        self.next_xid = 100

    def write(self, run_id: str, at_ms: float, xid: int | None = None) -> RunRow:
        if xid is None:
            xid, self.next_xid = self.next_xid, self.next_xid + 1
        values = {f.name: None for f in dataclasses.fields(RunRow)}
        values.update(id=f"run_{run_id}", created_at=T0, updated_at=T0 + timedelta(milliseconds=at_ms))
        run = RunRow(**values)  # type: ignore[arg-type]
        self.rows[run.id] = (run, xid)
        return run

    def read(self, running: int | None = None) -> ShapeRead:
        """What a read sees; ``running``: the oldest transaction still running (default: none is)."""
        runs = [r for r, _ in self.rows.values()]
        return ShapeRead(runs, {r.id: x for r, x in self.rows.values()},
                         (running if running is not None else self.next_xid) if runs else None)


def answer(read: ShapeRead, cursor: Cursor, room: int) -> tuple[list[RunRow], Cursor, bool]:
    """One answer that holds ``room`` runs, and the cursor it gives (round-tripped as an offset)."""
    pending, again = unsent(read, cursor)
    sent = min(room, len(pending))
    after = advance(cursor, read, pending, again, sent)
    assert parse_offset(after.offset()) == after
    return pending[:sent], after, sent == len(pending)


def sync(db: Db, cursor: Cursor, room: int, limit: int = 100) -> tuple[list[str], Cursor, int]:
    got: list[str] = []
    for n in range(1, limit):
        sent, cursor, complete = answer(db.read(), cursor, room)
        got += [r.id for r in sent]
        if complete:
            return got, cursor, n
    raise AssertionError("no end")


def test_an_initial_sync_in_parts_sends_every_run_once_in_order_of_change() -> None:
    db = Db()
    for i in random.Random(1).sample(range(20), 20):
        db.write(f"r{i:02}", at_ms=i // 3)  # three runs per millisecond
    got, cursor, _ = sync(db, START, room=4)
    assert got == [f"run_r{i:02}" for i in range(20)]
    assert unsent(db.read(), cursor) == ([], 0)  # nothing left: a live request waits


def test_a_late_commit_before_the_cursor_is_sent_and_only_it() -> None:
    db = Db()
    for i in range(10):
        db.write(f"a{i}", at_ms=1000 + i)
    late_xid = db.next_xid  # a transaction that began before the read and commits after it
    db.next_xid += 1
    read = db.read(running=late_xid)
    _, cursor, complete = answer(read, START, room=100)
    assert complete and cursor.at[1] == ALL and cursor.xmin == late_xid
    db.write("late", at_ms=1005, xid=late_xid)
    pending, again = unsent(db.read(), cursor)
    assert [r.id for r in pending] == ["run_late"] and again == 1
    _, cursor, complete = answer(db.read(), cursor, room=100)
    assert complete and unsent(db.read(), cursor) == ([], 0)


def test_late_commits_sent_in_parts_and_one_more_meanwhile() -> None:
    db = Db()
    for i in range(10):
        db.write(f"a{i}", at_ms=1000 + i)
    slow = db.next_xid  # one transaction writing many runs, committed after the read
    db.next_xid += 1
    _, cursor, _ = answer(db.read(running=slow), START, room=100)
    for i in range(7):
        db.write(f"b{i}", at_ms=1002, xid=slow)
    sent, cursor, complete = answer(db.read(), cursor, room=3)
    assert not complete and cursor.resend is not None and len(sent) == 3  # its place in the offset
    db.write("c", at_ms=1001, xid=slow)  # committed later still, before the part already resent
    got = [r.id for r in sent]
    more, cursor, _ = sync(db, cursor, room=3)
    assert {f"run_b{i}" for i in range(7)} | {"run_c"} <= set(got + more)
    assert unsent(db.read(), cursor) == ([], 0)


def test_runs_that_change_again_during_a_sync_in_parts_resend_nothing() -> None:
    """A batch of 1,000 runs made in one transaction, followed 32 runs an answer while it runs (a
    run changes before every request): each answer moves on, none is sent twice but those that
    changed (and come again after the cursor, as they must)."""
    db = Db()
    for i in range(1000):
        db.write(f"r{i:04}", at_ms=1000, xid=50)  # one transaction, long committed
    cursor, sends, answers, complete = START, 0, 0, False
    rng = random.Random(7)
    changed: set[str] = set()
    while not complete:
        run_id = f"r{rng.randrange(1000):04}"
        db.write(run_id, at_ms=1000 + answers + 1)  # it ran: a later change, in its own transaction
        changed.add(f"run_{run_id}")
        sent, cursor, complete = answer(db.read(), cursor, room=32)
        sends += len(sent)
        answers += 1
        assert answers < 100
    assert answers <= 40 and sends <= 1000 + len(changed)


def test_a_cursor_without_a_known_xmin_resends_the_whole_window() -> None:
    db = Db()
    for i in range(5):
        db.write(f"a{i}", at_ms=1000 + i)
    _, cursor, _ = answer(db.read(), START, room=100)
    legacy = parse_offset(f"{cursor.at[0]}_{cursor.checksum}")  # an offset of the earlier server
    assert legacy.xmin is None
    db.write("a2", at_ms=9000)  # one changed again: the window changed
    pending, again = unsent(db.read(), legacy)
    assert again == 4 and pending[-1].id == "run_a2"  # no way to tell a late commit apart: all again
    pending, again = unsent(db.read(), cursor)
    assert again == 0 and [r.id for r in pending] == ["run_a2"]
    too_old = dataclasses.replace(cursor, xmin=cursor.xmin - 2**31)  # type: ignore[operator]
    assert unsent(db.read(), too_old)[1] == 4


def test_runs_changed_after_the_cursor_come_after_it_and_in_the_same_microsecond_too() -> None:
    db = Db()
    for i in range(6):
        db.write(f"b{i}", at_ms=0, xid=10)  # one transaction: one updated_at
    running = db.next_xid
    db.next_xid += 1
    sent, cursor, _ = answer(db.read(running=running), START, room=2)
    assert [r.id for r in sent] == ["run_b0", "run_b1"] and cursor.at[1] == "run_b1"
    db.write("b0x", at_ms=0, xid=running)  # a late commit in that microsecond, before the cursor's id
    db.write("b9", at_ms=0, xid=running)  # and one after it
    more, _, _ = sync(db, cursor, room=2)
    assert set([r.id for r in sent] + more) == set(db.rows)


def test_a_window_older_than_grace_is_not_checked_again() -> None:
    db = Db()
    db.write("old", at_ms=0)
    db.write("new", at_ms=GRACE_US // 1000 + 10)
    _, cursor, _ = answer(db.read(), START, room=10)
    assert unsent(db.read(), cursor) == ([], 0)


@pytest.mark.parametrize("offset", ["", "1", "a_1", "1_a", "-1_2", "1_2__", "1_2_UP_", "1_2_x_y",
                                    "1_2_x_1_3_~", "1" * 21 + "_1", "1_2_" + "a" * 200 + "_1", "1_2_abc\n_1",
                                    "1_2_abc_1\n", "1_2_~_1_3_abc\n", "1\n_2", "1_2_a_²", "1_2_RUN_x_1"])
def test_an_offset_this_server_never_answered_with_is_refused(offset: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse_offset(offset)
    assert refused.value.status == 400


@pytest.mark.parametrize("offset", ["1_2_3", "1_2_", "1_2_a_3_4", "1_2_x_1_3_y_z", "1_2_run_x_1", "12_0_abc"])
def test_an_offset_of_another_version_tells_the_client_to_start_over(offset: str) -> None:
    with pytest.raises(Refetch):
        parse_offset(offset)


def test_offsets_round_trip() -> None:
    for cursor in (Cursor((5, ALL), 7), Cursor((5, "run_abc"), 7), Cursor((5, ALL), 7, 99),
                   Cursor((5, "run_abc"), 0, None, (3, "run_q")), Cursor((5, ALL), 7, 2**40, (4, "run_x2"))):
        assert parse_offset(cursor.offset()) == cursor
    assert Cursor((5, ALL), 7).offset() == "5_7"  # what clients of the earlier server hold


def _history(rng: random.Random) -> list[tuple[int, int, int, list[str]]]:
    """Transactions (xid, start ms, commit ms, runs written), xids in the order they start; each
    shorter than GRACE (the window's premise), some writing many runs at once (a batch)."""
    txns = []
    start = 0
    for xid in range(100, 100 + rng.randrange(5, 40)):
        start += rng.choice((0, 0, 1, 5, 50, 400))
        runs = [f"r{rng.randrange(12):02}" for _ in range(rng.choice((1, 1, 2, 6)))]
        txns.append((xid, start, start + rng.randrange(0, 1500), sorted(set(runs))))
    return txns


def _read(txns: list[tuple[int, int, int, list[str]]], now: int) -> ShapeRead:
    """What a read at ``now`` sees: each run as the last transaction committed by then wrote it."""
    latest: dict[str, tuple[int, int, int]] = {}  # run -> (commit, start, xid) of its visible version
    for xid, start, commit, runs in txns:
        if commit <= now:
            for run_id in runs:
                if run_id not in latest or latest[run_id][0] < commit:
                    latest[run_id] = (commit, start, xid)
    running = [xid for xid, start, commit, _ in txns if start <= now < commit]
    values = {f.name: None for f in dataclasses.fields(RunRow)}
    rows = [RunRow(**{**values, "id": f"run_{run_id}", "created_at": T0,  # type: ignore[arg-type]
                      "updated_at": T0 + timedelta(milliseconds=start)})
            for run_id, (_, start, _) in latest.items()]
    next_xid = 1 + max((xid for xid, start, _, _ in txns if start <= now), default=99)
    return ShapeRead(rows, {f"run_{run_id}": xid for run_id, (_, _, xid) in latest.items()},
                     (min(running) if running else next_xid) if rows else None)


@pytest.mark.parametrize("seed", range(300))
def test_no_change_is_lost_whatever_commits_late_and_wherever_answers_are_cut(seed: int) -> None:
    rng = random.Random(seed)
    txns = _history(rng)
    end = max(commit for _, _, commit, _ in txns) + 10
    have: dict[str, tuple[datetime, int]] = {}  # run -> the version the client holds (change, writer)
    cursor, now = START, rng.randrange(0, 200)
    for _ in range(400):
        read = _read(txns, now)
        pending, again = unsent(read, cursor)
        sent = min(rng.randrange(1, 5), len(pending))
        have.update((r.id, (r.updated_at, read.xmins[r.id])) for r in pending[:sent])
        cursor = advance(cursor, read, pending, again, sent)
        assert parse_offset(cursor.offset()) == cursor
        if now > end and not pending:
            break
        now += rng.choice((0, 1, 3, 30, 200))
    else:
        raise AssertionError("the client never caught up")
    final = _read(txns, end)
    assert have == {r.id: (r.updated_at, final.xmins[r.id]) for r in final.runs}  # every run, its last version
