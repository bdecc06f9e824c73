"""A journal is read a page at a time (16 MiB of results, 1,000 entries at most): a task that waited
thousands of times on one completed token of 3 MiB made every read of its journal gigabytes, in
the server every tenant shares. Pages are cut by sizes recorded when each value was written; an
entry past the page is not read whole."""

from __future__ import annotations

import psycopg

from run_engine.db.runs import JOURNAL_PAGE_BYTES, JOURNAL_PAGE_ENTRIES
from run_engine.engine import TriggerRequest

from .conftest import Harness

MIB = 1024 * 1024


async def started_run(h: Harness) -> tuple[str, str]:
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 1, start=True)
    assert d.run.id == run.id and d.started is not None
    return run.id, d.started.snapshot.id


async def test_waits_on_one_big_token_are_read_a_page_at_a_time(h: Harness, database_url: str) -> None:
    token, _ = await h.engine.create_token(h.env.env_id)
    big = "t" * (3 * MIB)
    assert await h.engine.complete_waitpoint(token.id, big)
    run_id, snapshot_id = await started_run(h)
    for seq in range(8):  # each returns at once (the token is completed) and journals a wait
        out = await h.engine.block(run_id, snapshot_id, sequence=seq, kind="token", key=token.id,
                                   waitpoint_ids=[token.id])
        assert not out.blocked
    each = len(big) + 2  # as JSON text
    per_page = -(-JOURNAL_PAGE_BYTES // each)  # the entries that start within the page's bytes
    first = await h.engine.resolved_journal(run_id)
    assert [e["sequence"] for e in first.entries] == list(range(per_page)) and first.next == per_page
    assert all(e["result"] == {"ok": True, "output": big} for e in first.entries)
    rest = await h.engine.resolved_journal(run_id, first.next)
    assert [e["sequence"] for e in rest.entries] == list(range(per_page, 8)) and rest.next is None
    # the size was recorded with the completion, once
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT output_bytes FROM waitpoint WHERE id = %s", (token.id,)).fetchone() == (each,)
    # retried, the dequeue that starts the run reads the same first page in its statement
    await h.engine.complete_attempt(run_id, snapshot_id, ok=False, error={"message": "again"})
    await h.advance(60)
    (again,) = await h.engine.dequeue(h.env.worker_group_id, 1, start=True)
    assert again.started is not None and again.started.attempt_number == 2
    journal = again.started.journal
    assert journal is not None and journal.next == per_page and len(journal.entries) == per_page
    assert journal.entries == first.entries


async def test_a_page_holds_a_thousand_entries_at_most(h: Harness) -> None:
    run_id, snapshot_id = await started_run(h)
    for seq in range(JOURNAL_PAGE_ENTRIES + 1):
        await h.engine.append_journal(run_id, snapshot_id, seq, "step", f"s{seq}", seq)
    first = await h.engine.resolved_journal(run_id)
    assert len(first.entries) == JOURNAL_PAGE_ENTRIES and first.next == JOURNAL_PAGE_ENTRIES
    assert [e["result"] for e in first.entries[:3]] == [0, 1, 2]
    rest = await h.engine.resolved_journal(run_id, first.next)
    assert [e["result"] for e in rest.entries] == [JOURNAL_PAGE_ENTRIES] and rest.next is None


async def test_an_entry_larger_than_a_page_is_a_page_of_its_own(h: Harness, database_url: str) -> None:
    """A size unknown (written by an older server) counts as the value's stored size; a page
    always holds one entry at least."""
    run_id, snapshot_id = await started_run(h)
    await h.engine.append_journal(run_id, snapshot_id, 0, "step", "small", "s")
    await h.engine.append_journal(run_id, snapshot_id, 1, "step", "big", "b" * (3 * MIB))
    await h.engine.append_journal(run_id, snapshot_id, 2, "step", "after", "a")
    with psycopg.connect(database_url) as conn:  # as if written before the sizes were recorded
        conn.execute("UPDATE task_run_journal SET result_bytes = NULL WHERE run_id = %s", (run_id,))
        conn.execute("UPDATE task_run_journal SET result_bytes = %s WHERE run_id = %s AND sequence = 0",
                     (JOURNAL_PAGE_BYTES, run_id))  # the first entry alone fills its page
    first = await h.engine.resolved_journal(run_id)
    assert [e["sequence"] for e in first.entries] == [0] and first.next == 1
    second = await h.engine.resolved_journal(run_id, 1)
    assert [e["sequence"] for e in second.entries] == [1, 2] and second.next is None
    assert second.entries[0]["result"] == "b" * (3 * MIB)


async def test_the_sizes_of_live_journals_written_before_they_were_recorded_are_filled_in(
        h: Harness, database_url: str) -> None:
    """Migration 0027: the journals of runs not finished, and the waitpoints they name, get their
    sizes; finished runs' are left as they are."""
    import re

    from run_engine.db.migrations import available_migrations

    (migration,) = [m for m in available_migrations() if m.path.name.startswith("0027_")]
    token, _ = await h.engine.create_token(h.env.env_id)
    assert await h.engine.complete_waitpoint(token.id, "o" * 1000)
    live, live_snapshot = await started_run(h)
    await h.engine.block(live, live_snapshot, sequence=0, kind="token", key=token.id, waitpoint_ids=[token.id])
    await h.engine.append_journal(live, live_snapshot, 1, "step", "s", "r" * 500)
    done, done_snapshot = await started_run(h)
    await h.engine.append_journal(done, done_snapshot, 0, "step", "s", "d" * 500)
    await h.engine.complete_attempt(done, done_snapshot, ok=True, output=1)
    with psycopg.connect(database_url, autocommit=True) as conn:  # as an older server left them
        conn.execute("UPDATE task_run_journal SET result_bytes = NULL WHERE run_id = ANY(%s)", ([live, done],))
        conn.execute("UPDATE waitpoint SET output_bytes = NULL WHERE id = %s", (token.id,))
        for statement in re.split(r"^-- next$", migration.path.read_text(), flags=re.MULTILINE):
            conn.execute(statement)
        sizes = dict(conn.execute("SELECT run_id || '/' || sequence, result_bytes FROM task_run_journal "
                                  "WHERE run_id = ANY(%s)", ([live, done],)).fetchall())
        (output_bytes,) = conn.execute("SELECT output_bytes FROM waitpoint WHERE id = %s", (token.id,)).fetchone()
    assert sizes == {f"{live}/0": 0, f"{live}/1": 502, f"{done}/0": None}
    assert output_bytes == 1002
