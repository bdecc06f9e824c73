"""SQL of waitpoints, blocking, the journal, checkpoints and batches (DESIGN §7).

Blocking and completing never lose a wake-up: ``block`` commits the run's blocking rows and then
counts the pending waitpoints; ``complete_*`` commits the completion and then reads the blocked
runs. Whichever commits second sees the other's write, and continuing a run is idempotent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import orjson
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from run_engine.batching import committed
from run_engine.db.bounded import bounded_read
from run_engine.db.rows import from_prefixed, from_row, select_as, to_columns
from run_engine.db.runs import (
    LATEST_OF_INPUT,
    PAGE_BYTES,
    RunRow,
    Snapshot,
    TransitionResult,
    journal_page,
    page_walk,
    transition_result,
    walked_page,
)
from run_engine.errors import ConflictError
from run_engine.records import record


@record
class Waitpoint:
    id: str
    env_id: str
    type: str
    status: str
    completed_by_run_id: str | None
    completed_by_batch_id: str | None
    completed_after: datetime | None
    completed_at: datetime | None
    idempotency_key: str | None
    idempotency_key_expires_at: datetime | None
    output: Any
    output_is_error: bool
    timeout_at: datetime | None
    tags: list[str]
    created_at: datetime


def _waitpoint(row: dict[str, Any]) -> Waitpoint:
    return from_row(Waitpoint, row)


@record
class NewWaitpoint:
    id: str
    env_id: str
    type: str
    completed_by_run_id: str | None = None
    completed_by_batch_id: str | None = None
    completed_after: datetime | None = None
    idempotency_key: str | None = None
    idempotency_key_expires_at: datetime | None = None
    timeout_at: datetime | None = None
    tags: tuple[str, ...] = ()


@record
class JournalEntry:
    sequence: int
    kind: str
    key: str
    result: Any
    waitpoint_id: str | None
    waitpoint_status: str | None = None
    waitpoint_output: Any = None
    waitpoint_output_is_error: bool = False


#: the waiting runs and pending RUN waitpoints one pass of the sweeper walks (each kind)
SWEEP_WALK = 5000


@record
class SweepCursors:
    """Where the sweeper's next pass goes on: after these ids ('': from the start)."""

    runs: str = ""
    waitpoints: str = ""


@record
class JournalPage:
    """Entries of a journal in order, and the sequence of the first one past them (None: no more)."""

    entries: list[JournalEntry]
    next: int | None = None


def journal_page_of(rows: Sequence[dict[str, Any]]) -> JournalPage:
    """The page that rows of :func:`journal_page` (or their JSON objects) make."""
    entries: list[JournalEntry] = []
    for row in rows:
        if not row.get("delivered", True):
            return JournalPage(entries, int(row["sequence"]))
        entries.append(journal_entry(row))
    return JournalPage(entries)


def json_bytes(value: Any) -> int:
    """What ``value`` takes as JSON text (what a journal page counts it for)."""
    return 0 if value is None else len(orjson.dumps(value))


def journal_entry(row: dict[str, Any]) -> JournalEntry:
    """An entry as :data:`_JOURNALS` reads it, or as a JSON object of the same fields (the journal
    that ``RunRepository.dequeue_and_start`` returns with a restored run)."""
    return JournalEntry(row["sequence"], row["kind"], row["key"], row["result"], row["waitpoint_id"],
                        row["waitpoint_status"], row["waitpoint_output"], bool(row["waitpoint_output_is_error"]))


@record
class Blocked:
    """What :meth:`WaitpointRepository.block_executing` did: the transition (not applied when the
    run was not the caller's EXECUTING snapshot, or nothing was pending), the journal entry that
    was already at the sequence, whether the wait was written (not: another entry is there), and
    the waitpoints pending when it ran."""

    transition: TransitionResult
    existing: JournalEntry | None
    allowed: bool
    pending: int
    suspended: Snapshot | None = None  # the SUSPENDED snapshot, when the write asked to suspend
    missing: bool = False  # the waitpoint is gone (or not of the write's environment): nothing was written


@record
class BlockWrite:
    """One run's part of :meth:`WaitpointRepository.block_executing`: journal ``entry`` and block the
    run, whose latest snapshot must be ``expected_snapshot_id`` in EXECUTING, on ``waitpoint_ids``."""

    run_id: str
    expected_snapshot_id: str
    entry: JournalEntry
    waitpoint_ids: Sequence[str]
    new_snapshot_id: str
    description: str
    # suspend the run too if it blocks: (checkpoint id, SUSPENDED snapshot id)
    suspend: tuple[str, str] | None = None
    # the environment the entry's waitpoint must be of; its key is then the waitpoint's
    env_id: str | None = None


@record
class Completion:
    """Complete the waitpoint ``id`` (or the RUN waitpoint of ``run_id``) with ``output``; with
    ``env_id``, only a MANUAL waitpoint (a token) of that environment (a completion by API key:
    another environment's waitpoint is left alone as if it did not exist)."""

    output: Any
    is_error: bool = False
    id: str | None = None
    run_id: str | None = None
    env_id: str | None = None


# Whether the waitpoint ``{id}`` names is pending, asked per row through its primary key. A join on
# ``w.status = 'PENDING'`` lets the planner take the partial index of pending waitpoints instead, which
# on a table that grew faster than its statistics (a burst of tokens, a new installation) it believes
# tiny: it then read every pending waitpoint for each run or completion (quadratic under load).
_IS_PENDING = "(SELECT w.status FROM waitpoint w WHERE w.id = {id}) = 'PENDING'"


#: a page of MANUAL waitpoints (tokens), bounded in their outputs' bytes (list_tokens)
_TOKEN_PAGE = page_walk("waitpoint", """environment_id = %(env)s AND type = 'MANUAL'
    AND (%(statuses)s::text[] IS NULL OR status = ANY(%(statuses)s))
    AND (%(timed_out)s::bool IS NULL OR status = 'PENDING' OR output_is_error = %(timed_out)s)
    AND (%(tags)s::text[] IS NULL OR tags && %(tags)s)
    AND (%(key)s::text IS NULL OR idempotency_key = %(key)s)
    AND (%(from)s::timestamptz IS NULL OR created_at >= %(from)s)
    AND (%(to)s::timestamptz IS NULL OR created_at < %(to)s)
    AND (%(after_ts)s::timestamptz IS NULL OR (created_at, id) < (%(after_ts)s, %(after_id)s))""",
                        "coalesce(octet_length(output::text), 0)")

_INSERT_WAITPOINT = """
INSERT INTO waitpoint (id, environment_id, type, completed_by_run_id, completed_by_batch_id, completed_after,
                       idempotency_key, idempotency_key_expires_at, user_provided_idempotency_key, timeout_at, tags)
SELECT id, environment_id, type, completed_by_run_id, completed_by_batch_id, completed_after,
       idempotency_key, idempotency_key_expires_at, idempotency_key IS NOT NULL, timeout_at, coalesce(tags, '{}')
FROM jsonb_to_recordset(%(rows)s::jsonb) AS t(
    id text, environment_id text, type text, completed_by_run_id text, completed_by_batch_id text,
    completed_after timestamptz, idempotency_key text, idempotency_key_expires_at timestamptz,
    timeout_at timestamptz, tags text[])
ON CONFLICT (environment_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING *
"""

_COMPLETE = """
-- complete pending waitpoints by id or by the run that completes them; first completion wins
-- (a completion naming an environment only completes a token of that environment)
-- The waitpoints are found per input row (primary key, or the run's index) and then updated by id; the
-- status is tested in a CASE so that the planner cannot read the pending ones through their partial
-- index instead (see _IS_PENDING).
-- Two completions of one waitpoint in the same statement: the first (by ``ord``, the callers' order)
-- of those allowed to complete it is the one applied and reported.
WITH input AS (
    SELECT * FROM jsonb_to_recordset(%(rows)s::jsonb) AS t(ord int, id text, run_id text, output jsonb,
                                                          is_error bool, env_id text)
), targets AS MATERIALIZED (
    SELECT DISTINCT ON (x.id) i.output, i.is_error, i.ord, x.id FROM input i CROSS JOIN LATERAL (
        SELECT w.id FROM waitpoint w
        WHERE w.id = i.id AND (i.env_id IS NULL OR (w.environment_id = i.env_id AND w.type = 'MANUAL'))
        UNION ALL
        SELECT w.id FROM waitpoint w WHERE i.id IS NULL AND w.completed_by_run_id = i.run_id AND w.type = 'RUN') x
    ORDER BY x.id, i.ord
)
UPDATE waitpoint w SET status = 'COMPLETED', completed_at = now(), output = t.output, output_is_error = t.is_error,
    output_bytes = octet_length(t.output::text)  -- what a journal page counts it for (never measured again)
FROM targets t
WHERE w.id = ANY(ARRAY(SELECT id FROM targets)) AND w.id = t.id
  AND CASE WHEN w.status = 'PENDING' THEN true ELSE false END
-- `timed`: an engine job is armed
RETURNING w.id, (w.timeout_at IS NOT NULL OR w.type = 'DATETIME') AS timed, t.ord
"""

_BLOCKED_RUNS = """
-- the runs blocked on any of %(ids)s, by run id after %(after)s, %(limit)s at most: a range of the
-- (waitpoint, run) index per waitpoint, %(limit)s rows of it at most. Written as one condition on
-- the table (waitpoint_id = ANY, ORDER BY run_id LIMIT), its generic plan walked the primary key
-- (run, waitpoint) in run order and filtered every row blocked on anything (its estimate of the
-- waitpoints' rows stale while the table fills): 6 ms a completion with 10,000 runs waiting, the
-- whole table's index each time with a million
SELECT DISTINCT b.run_id
FROM unnest(%(ids)s::text[]) AS w(id)
CROSS JOIN LATERAL (SELECT trw.run_id FROM task_run_waitpoint trw
                    WHERE trw.waitpoint_id = w.id AND trw.run_id > %(after)s
                    ORDER BY trw.run_id LIMIT %(limit)s) b
ORDER BY b.run_id LIMIT %(limit)s
"""

_SWEEP_RUN_WAITPOINTS = """
-- a slice of the pending RUN waitpoints (after %(after)s, in id order, %(walk)s at most), each with
-- its run: finished (the waitpoint's completion was lost in a crash between the two writes) or never
-- created (the process died, or the insert failed, between the parent's journal entry and its
-- child; an orphan once past the grace)
SELECT w.id, r.finished_at IS NOT NULL AS finished,
       r.id IS NULL AND w.created_at < now() - make_interval(secs => %(grace_s)s) AS orphaned
FROM (SELECT id, completed_by_run_id, created_at FROM waitpoint
      WHERE status = 'PENDING' AND type = 'RUN' AND id > %(after)s ORDER BY id LIMIT %(walk)s) w
LEFT JOIN task_run r ON r.id = w.completed_by_run_id
ORDER BY w.id
"""

_FINISHED_RUNS_OF_WAITPOINTS = """
-- the outcome of the finished run of each RUN waitpoint of %(ids)s still pending
SELECT w.id, r.status, r.output, r.error
FROM waitpoint w JOIN task_run r ON r.id = w.completed_by_run_id
WHERE w.id = ANY(%(ids)s) AND w.status = 'PENDING' AND r.finished_at IS NOT NULL
"""

_SWEEP_BATCHES = """
-- BATCH waitpoints whose children have all finished, or whose batch never got all its runs
SELECT w.id, b.id AS batch_id, b.size, c.created, c.finished,
       (c.created < b.size AND b.created_at < now() - make_interval(secs => %(grace_s)s)) AS broken
FROM waitpoint w
JOIN batch_task_run b ON b.id = w.completed_by_batch_id
CROSS JOIN LATERAL (
    SELECT count(*) AS created, count(*) FILTER (WHERE r.finished_at IS NOT NULL) AS finished
    FROM task_run r WHERE r.batch_id = b.id
) c
WHERE w.status = 'PENDING' AND w.type = 'BATCH'
  AND (c.finished >= b.size OR (c.created < b.size AND b.created_at < now() - make_interval(secs => %(grace_s)s)))
LIMIT %(limit)s
"""

#: the finished children of batch ``b`` (a scalar subquery of an UPDATE of batch_task_run b)
_FINISHED_CHILDREN = "(SELECT count(*) FROM task_run r WHERE r.batch_id = b.id AND r.finished_at IS NOT NULL)"

#: the indexes of batch %(batch)s that have a run (task_run.batch_index, migration 0053: a streamed
#: batch's runs; made by a stream that may not have noted them yet). Not correlated with the row
#: updated (its id is the parameter): evaluated once, hashed
_INDEXES_RUN = ("(SELECT r.batch_index FROM task_run r"
                " WHERE r.batch_id = %(batch)s AND r.batch_index IS NOT NULL)")
#: the failures of %(failed)s a note counts: those of indexes not sent before (of the row as it was),
#: not made by this note and with no run of the batch
_NEWLY_FAILED = ("(SELECT count(*) FROM unnest(%(failed)s::integer[]) AS f(i)"
                 " WHERE NOT f.i = ANY(b.items_seen) AND NOT f.i = ANY(%(made)s::integer[])"
                 f" AND f.i NOT IN {_INDEXES_RUN})::integer")
#: the failures of batch ``b`` a note drops: an index made by this note, or that has a run of the
#: batch, after another stream noted it failed (two overlapping streams: one failed it, the other
#: made its run) is no longer counted failed
_UNFAILING = ("(SELECT k.i FROM jsonb_object_keys(b.item_errors) AS k(i)"
              f" WHERE k.i::integer = ANY(%(made)s::integer[]) OR k.i::integer IN {_INDEXES_RUN})")
_UNFAILED = f"(SELECT count(*) FROM {_UNFAILING} AS u)::integer"
#: the runs batch ``b`` completes with, its newly failed items counted and its failures made dropped
_RUNS_LEFT = f"(b.size - b.items_failed - {_NEWLY_FAILED} + {_UNFAILED})"
#: whether the failures the note counts complete batch ``b``, as count_finished_children would have
#: had they been counted first: its finished children (counted as they finish) reach the runs left
_NOTE_COMPLETES = f"""(b.status = 'PENDING' AND {_NEWLY_FAILED} > 0 AND b.completed_count >= {_RUNS_LEFT}
                       AND {_FINISHED_CHILDREN} >= {_RUNS_LEFT})"""

_NOTE_BATCH_ITEMS = """
-- note a batch's items sent: %(made)s triggered, %(failed)s failed on their own with %(errors)s
-- ({"<index>": {taskIdentifier, error, errorCode}}). Every expression reads the row as it was (the
-- transaction locked it first), so a failure is kept, and counted, only for an index not sent
-- before (nor made by this note, nor holding a run of the batch: task_run.batch_index); an index
-- made, or holding a run, that was noted failed (two overlapping streams: one failed it, the other
-- then made its run) has its failure dropped and uncounted, so that no index is both a run and a
-- failure (the batch would complete before that run finished); and in
-- the same statement the batch completes if its runs had all finished but for these failures
-- (they may be noted after its runs finished: a later stream, a retry after dying before the
-- note). Returns the indexes sent.
UPDATE batch_task_run b
SET items_seen = ARRAY(SELECT DISTINCT i FROM unnest(b.items_seen || %(made)s::integer[] || %(failed)s::integer[])
                       AS i ORDER BY i),
    item_errors = (b.item_errors - ARRAY""" + _UNFAILING + """)
                  || coalesce((SELECT jsonb_object_agg(e.key, e.value) FROM jsonb_each(%(errors)s) e
                               WHERE NOT e.key::integer = ANY(b.items_seen)
                                 AND NOT e.key::integer = ANY(%(made)s::integer[])
                                 AND e.key::integer NOT IN """ + _INDEXES_RUN + """), '{}'::jsonb),
    items_failed = b.items_failed + """ + _NEWLY_FAILED + " - " + _UNFAILED + """,
    completed_count = CASE WHEN b.status = 'PENDING' AND """ + _NEWLY_FAILED + """ > 0
                                AND b.completed_count >= """ + _RUNS_LEFT + """
                           THEN """ + _FINISHED_CHILDREN + """ ELSE b.completed_count END,
    status = CASE WHEN """ + _NOTE_COMPLETES + """ THEN 'COMPLETED' ELSE b.status END,
    completed_at = CASE WHEN """ + _NOTE_COMPLETES + """ THEN now() ELSE b.completed_at END
WHERE b.id = %(batch)s RETURNING cardinality(b.items_seen)
"""

_BATCH_WAITPOINTS = """
-- the pending BATCH waitpoints of %(batches)s (the status in a CASE: not the pending index, see _IS_PENDING)
SELECT id FROM waitpoint
WHERE completed_by_batch_id = ANY(%(batches)s) AND CASE WHEN status = 'PENDING' THEN true ELSE false END
"""

_SWEEP_STUCK_RUNS = """
-- a slice of the runs shown as WAITING (after %(after)s, in id order, %(walk)s at most), each with
-- whether no pending waitpoint blocks it any more (a lost continuation). Each run's blocking rows
-- are looked up by the run (LATERAL ... LIMIT 1): as a NOT EXISTS on the whole table the planner,
-- expecting every waiting run, hashed every blocking row of every run for each slice
SELECT r.id, r.updated_at < now() - make_interval(secs => %(grace_s)s) AND p.run_id IS NULL AS stuck
FROM (SELECT id, updated_at FROM task_run WHERE status = 'WAITING' AND id > %(after)s ORDER BY id LIMIT %(walk)s) r
LEFT JOIN LATERAL (SELECT trw.run_id FROM task_run_waitpoint trw
                   WHERE trw.run_id = r.id AND """ + _IS_PENDING.format(id="trw.waitpoint_id") + """ LIMIT 1) p ON true
ORDER BY r.id
"""


_PENDING_OF_RUN = """(SELECT count(*) FROM task_run_waitpoint trw
                      WHERE trw.run_id = %(run)s AND """ + _IS_PENDING.format(id="trw.waitpoint_id") + ")"

_SUSPEND = """
-- suspend: for each input run, its REPLAY checkpoint at its journal position and the SUSPENDED snapshot
-- carrying it, applied only if the run's latest valid snapshot is `expected` in EXECUTING_WITH_WAITPOINTS
-- and the snapshot wins the run's next place in the chain (`conflict`: another writer took it first;
-- nothing is written for that run); with the count of its pending waitpoints (its blocking rows were
-- committed by the block before: no race). One statement for many runs, in id order.
WITH input AS (
    SELECT * FROM jsonb_to_recordset(%(rows)s::jsonb) AS t(run_id text, expected text, checkpoint text, new text)
), latest AS (
    SELECT i.*, l.id AS latest_id, l.engine_status AS latest_status, l.attempt_number
    FROM input i""" + LATEST_OF_INPUT + """
), ok AS (
    SELECT l.*, (SELECT coalesce(max(sequence) + 1, 0) FROM task_run_journal WHERE run_id = l.run_id) AS position
    FROM latest l WHERE l.latest_id = l.expected AND l.latest_status = 'EXECUTING_WITH_WAITPOINTS'
), snap AS (
    INSERT INTO task_run_execution_snapshot (id, run_id, engine_status, run_status, attempt_number, description,
                                             previous_snapshot_id, checkpoint_id)
    SELECT new, run_id, 'SUSPENDED', 'WAITING', attempt_number,
           'Suspended: checkpoint at journal position ' || position, latest_id, checkpoint FROM ok ORDER BY run_id
    ON CONFLICT (previous_snapshot_id) WHERE is_valid AND previous_snapshot_id IS NOT NULL DO NOTHING
    RETURNING *
), cp AS (
    INSERT INTO task_run_checkpoint (id, run_id, snapshot_id, type, journal_position)
    SELECT ok.checkpoint, ok.run_id, ok.latest_id, 'REPLAY', ok.position FROM ok JOIN snap ON snap.run_id = ok.run_id
    RETURNING id
), upd AS (
    UPDATE task_run r SET status = 'WAITING', updated_at = clock_timestamp() FROM snap WHERE r.id = snap.run_id
    RETURNING r.*
)
SELECT l.run_id, l.latest_id, l.latest_status, """ + select_as("snap", Snapshot, "s") + """,
       """ + select_as("upd", RunRow, "r") + """,
       (ok.run_id IS NOT NULL AND snap.id IS NULL) AS conflict,
       (SELECT count(*) FROM task_run_waitpoint trw
        WHERE trw.run_id = l.run_id AND """ + _IS_PENDING.format(id="trw.waitpoint_id") + """) AS pending
FROM latest l LEFT JOIN ok ON ok.run_id = l.run_id LEFT JOIN snap ON snap.run_id = l.run_id
LEFT JOIN upd ON upd.id = l.run_id
"""

#: the most the results of child runs replayed at once may take (see run_results)
RESULTS_BYTES = 64 * 1024 * 1024

_SEQUENCE_MAX = 2**31 - 1  # task_run_journal.sequence is an integer

_JOURNALS = """
-- a page of the journal of each input run from its sequence on, each wait with its waitpoint's state
SELECT i.ord, j.*
FROM unnest(%(runs)s::text[], %(froms)s::int[]) WITH ORDINALITY AS i(run_id, from_seq, ord)
CROSS JOIN LATERAL """ + journal_page("i.run_id", "i.from_seq") + """ j
ORDER BY i.ord, j.sequence
"""

_PENDING_OF_RUNS = """
-- the pending waitpoints of each run of %(runs)s (each blocking row looked up by primary key, see _IS_PENDING)
SELECT i.run_id, (SELECT count(*) FROM task_run_waitpoint trw
               WHERE trw.run_id = i.run_id AND """ + _IS_PENDING.format(id="trw.waitpoint_id") + """) AS pending
FROM unnest(%(runs)s::text[]) AS i(run_id)
"""

_CONTINUE = """
-- continue: each blocked run (EXECUTING_WITH_WAITPOINTS, or SUSPENDED) none of whose waitpoints is
-- pending any more goes on: EXECUTING in its executor, or QUEUED_EXECUTING to be restored (keeping its
-- checkpoint), carrying the waitpoints it was blocked on, and loses its blocking rows. One statement
-- for many runs, no run lock: nothing is written for a run unless it is blocked, nothing blocks it and
-- its new snapshot won the run's next place in the chain (its blocking rows are only deleted then).
-- `conflict`: the run was ready to continue but another writer (a suspend, a cancel, another
-- continue) took that place first; the caller looks again. Runs in id order (lock order).
WITH input AS (
    SELECT * FROM unnest(%(runs)s::text[], %(news)s::text[]) AS i(run_id, new_id)
), latest AS (
    SELECT i.run_id, i.new_id, l.id, l.engine_status, l.attempt_number, l.checkpoint_id
    FROM input i LEFT JOIN LATERAL (
        SELECT s.id, s.engine_status, s.attempt_number, s.checkpoint_id FROM task_run_execution_snapshot s
        WHERE s.run_id = i.run_id AND s.is_valid ORDER BY s.seq DESC LIMIT 1) l ON true
), ok AS (
    SELECT l.*, l.engine_status = 'SUSPENDED' AS restore,
           coalesce((SELECT array_agg(trw.waitpoint_id ORDER BY trw.waitpoint_id) FROM task_run_waitpoint trw
                     WHERE trw.run_id = l.run_id), '{}') AS waitpoints
    FROM latest l
    WHERE l.engine_status IN ('EXECUTING_WITH_WAITPOINTS', 'SUSPENDED')
      AND NOT EXISTS (SELECT 1 FROM task_run_waitpoint trw
                      WHERE trw.run_id = l.run_id AND """ + _IS_PENDING.format(id="trw.waitpoint_id") + """)
), snap AS (
    INSERT INTO task_run_execution_snapshot (id, run_id, engine_status, run_status, attempt_number, description,
                                             previous_snapshot_id, checkpoint_id, completed_waitpoint_ids)
    SELECT ok.new_id, ok.run_id,
           CASE WHEN ok.restore THEN 'QUEUED_EXECUTING' ELSE 'EXECUTING' END,
           CASE WHEN ok.restore THEN 'QUEUED' ELSE 'EXECUTING' END,
           ok.attempt_number,
           CASE WHEN ok.restore THEN 'Waitpoints completed: queued to restore' ELSE 'Waitpoints completed' END,
           ok.id, CASE WHEN ok.restore THEN ok.checkpoint_id END, ok.waitpoints
    FROM ok ORDER BY ok.run_id
    ON CONFLICT (previous_snapshot_id) WHERE is_valid AND previous_snapshot_id IS NOT NULL DO NOTHING
    RETURNING *
), del AS (
    DELETE FROM task_run_waitpoint trw USING snap WHERE trw.run_id = snap.run_id RETURNING trw.run_id
), upd AS (
    UPDATE task_run r SET status = snap.run_status, updated_at = clock_timestamp() FROM snap WHERE r.id = snap.run_id
    RETURNING r.*
)
SELECT l.run_id, l.id AS latest_id, l.engine_status AS latest_status, """ + select_as("snap", Snapshot, "s") + """,
       """ + select_as("upd", RunRow, "r") + """, (ok.run_id IS NOT NULL AND snap.id IS NULL) AS conflict
FROM latest l LEFT JOIN ok ON ok.run_id = l.run_id LEFT JOIN snap ON snap.run_id = l.run_id
LEFT JOIN upd ON upd.id = l.run_id
"""

_BLOCK = """
-- block: for each input run, journal the wait at `seq`, block the run on `wps` and move it to
-- EXECUTING_WITH_WAITPOINTS, applied only if its latest valid snapshot is `expected` in EXECUTING and the
-- new snapshot wins the run's next place in the chain (`conflict`: another writer took it first, and
-- nothing is written for that run). An entry already at `seq` is returned: the same wait (a replay)
-- blocks again; another is a duplicate execution and changes nothing. The snapshot and the blocking
-- rows are only written while one of the waitpoints is pending (the journal entry is written either
-- way); the caller counts again after the commit (a completion committed meanwhile did not see these
-- blocking rows). With `suspend_new`, a run blocked is also suspended: its REPLAY checkpoint
-- `checkpoint` at its journal position and the SUSPENDED snapshot carrying it, after the other (one
-- commit for both). The waitpoint `wp` the entry names is locked FOR KEY SHARE until the commit, so that
-- retention (which deletes a completed one, locked FOR UPDATE SKIP LOCKED, only when no journal entry
-- names it, checked again after its lock) passes over it, and one it deleted first is not found:
-- `missing`, and nothing is written (an entry naming a deleted waitpoint would never resolve). With
-- `env`, `wp` must also be of that environment (else `missing`) and the entry's key is the waitpoint's
-- (the batch or run it stands for, or its id). One statement for many runs, in id order.
WITH given AS (
    SELECT * FROM jsonb_to_recordset(%(rows)s::jsonb) AS t(run_id text, expected text, seq int, kind text, key text,
                                                          result jsonb, wp text, wps text[], new text,
                                                          description text, suspend_new text, checkpoint text,
                                                          env text)
), named AS MATERIALIZED (
    -- by primary key; a row deleted by a delete committed while the lock waited is skipped
    SELECT w.id, w.environment_id, coalesce(w.completed_by_batch_id, w.completed_by_run_id, w.id) AS wp_key
    FROM waitpoint w WHERE w.id = ANY(ARRAY(SELECT wp FROM given)) FOR KEY SHARE
), named_by_id AS MATERIALIZED (
    -- one row, an object by waitpoint id: looked up per input row in O(log n) (a subquery per row
    -- over `named` read all of it for each: n^2 rows, tests/integration/test_batch_plans.py)
    SELECT coalesce(jsonb_object_agg(n.id, jsonb_build_array(n.environment_id, n.wp_key)), '{}'::jsonb) AS m
    FROM named n
), looked_up AS (
    SELECT g.*, CASE WHEN g.env IS NULL OR nb.m -> g.wp ->> 0 = g.env THEN nb.m -> g.wp ->> 1 END AS wp_key
    FROM given g CROSS JOIN named_by_id nb
), input AS (
    SELECT run_id, expected, seq, kind, CASE WHEN env IS NOT NULL THEN coalesce(wp_key, key) ELSE key END AS key,
           result, wp, wps, new, description, suspend_new, checkpoint, wp_key IS NULL AS missing
    FROM looked_up
), latest AS (
    SELECT i.*, l.id AS latest_id, l.engine_status AS latest_status, l.attempt_number
    FROM input i""" + LATEST_OF_INPUT + """
), ok AS (
    SELECT * FROM latest WHERE latest_id = expected AND latest_status = 'EXECUTING' AND NOT missing
), existing AS (
    SELECT ok.run_id, j.sequence, j.kind, j.key, j.result, j.waitpoint_id
    FROM ok JOIN task_run_journal j ON j.run_id = ok.run_id AND j.sequence = ok.seq
), allowed AS (
    SELECT ok.* FROM ok
    WHERE NOT EXISTS (SELECT 1 FROM existing e WHERE e.run_id = ok.run_id AND (e.kind <> ok.kind
                      OR e.waitpoint_id IS NULL OR NOT (e.waitpoint_id = ANY(ok.wps))))
), pending AS (
    SELECT a.*, (SELECT count(*) FROM (
        SELECT unnest(a.wps) AS id UNION SELECT waitpoint_id FROM task_run_waitpoint WHERE run_id = a.run_id
    ) ids WHERE """ + _IS_PENDING.format(id="ids.id") + """) AS n,
           greatest((SELECT max(sequence) FROM task_run_journal WHERE run_id = a.run_id), a.seq) + 1 AS position
    FROM allowed a
), snap AS (
    INSERT INTO task_run_execution_snapshot (id, run_id, engine_status, run_status, attempt_number, description,
                                             previous_snapshot_id)
    SELECT new, run_id, 'EXECUTING_WITH_WAITPOINTS', 'WAITING', attempt_number, description, latest_id
    FROM pending WHERE n > 0 ORDER BY run_id
    ON CONFLICT (previous_snapshot_id) WHERE is_valid AND previous_snapshot_id IS NOT NULL DO NOTHING
    RETURNING *
), blocked AS MATERIALIZED (
    -- each run blocked, to its new snapshot's id and attempt: one object, computed once and looked
    -- up by each row below. Never a join of `pending` and `snap`: the planner expects one row of each
    -- and joins them by a nested loop, n^2 rows read (see runs.py's _TRANSITION_SQL)
    SELECT coalesce(jsonb_object_agg(run_id, jsonb_build_array(id, attempt_number)), '{}') AS m FROM snap
), journal AS (
    INSERT INTO task_run_journal (run_id, sequence, kind, key, result, waitpoint_id, result_bytes)
    SELECT p.run_id, p.seq, p.kind, p.key, p.result, p.wp, coalesce(octet_length(p.result::text), 0)
    FROM pending p CROSS JOIN blocked b
    WHERE NOT EXISTS (SELECT 1 FROM existing e WHERE e.run_id = p.run_id) AND (p.n = 0 OR b.m ? p.run_id)
    ON CONFLICT DO NOTHING RETURNING run_id
), blocking AS (
    INSERT INTO task_run_waitpoint (run_id, waitpoint_id)
    SELECT p.run_id, unnest(p.wps) FROM pending p CROSS JOIN blocked b WHERE b.m ? p.run_id
    ON CONFLICT DO NOTHING RETURNING run_id
), susp AS (
    INSERT INTO task_run_execution_snapshot (id, run_id, engine_status, run_status, attempt_number, description,
                                             previous_snapshot_id, checkpoint_id)
    SELECT p.suspend_new, p.run_id, 'SUSPENDED', 'WAITING', (b.m -> p.run_id ->> 1)::int,
           'Suspended: checkpoint at journal position ' || p.position, b.m -> p.run_id ->> 0, p.checkpoint
    FROM pending p CROSS JOIN blocked b WHERE b.m ? p.run_id AND p.suspend_new IS NOT NULL ORDER BY p.run_id
    RETURNING *
), cp AS (
    INSERT INTO task_run_checkpoint (id, run_id, snapshot_id, type, journal_position)
    SELECT p.checkpoint, p.run_id, b.m -> p.run_id ->> 0, 'REPLAY', p.position
    FROM pending p CROSS JOIN blocked b WHERE b.m ? p.run_id AND p.suspend_new IS NOT NULL
    RETURNING id
), upd AS (
    UPDATE task_run r SET status = 'WAITING', updated_at = clock_timestamp() FROM snap WHERE r.id = snap.run_id
    RETURNING r.*
)
SELECT l.run_id, l.latest_id, l.latest_status, l.missing,
       (SELECT to_jsonb(e) - 'run_id' FROM existing e WHERE e.run_id = l.run_id) AS existing,
       p.run_id IS NOT NULL AS allowed, p.n AS pending, """ + select_as("snap", Snapshot, "s") + """,
       """ + select_as("upd", RunRow, "r") + """,
       (p.n > 0 AND snap.id IS NULL) AS conflict, """ + select_as("susp", Snapshot, "x") + """
FROM latest l LEFT JOIN pending p ON p.run_id = l.run_id LEFT JOIN snap ON snap.run_id = l.run_id
LEFT JOIN susp ON susp.run_id = l.run_id LEFT JOIN upd ON upd.id = l.run_id
"""


class WaitpointRepository:
    def __init__(self, pool: AsyncConnectionPool) -> None:
        self.pool = pool

    # --- waitpoints ---------------------------------------------------------------------------

    async def create(self, wp: NewWaitpoint, now: datetime | None = None) -> tuple[Waitpoint, bool]:
        """Insert ``wp``; with an idempotency key that is taken and not expired (at ``now``),
        return the existing waitpoint and ``True`` (cached) instead. An expired key is released. A
        key let go between the insert that found it taken and the look-up of its holder (a RUN
        waitpoint's, by a wait on its run redriven since; a waitpoint deleted by retention) is
        free: the insert is tried again."""
        if wp.idempotency_key is None:
            return (await self.create_many([wp]))[0], False
        row = to_columns(wp)
        async with self.pool.connection() as conn, conn.transaction():
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """UPDATE waitpoint SET idempotency_key = NULL
                   WHERE environment_id = %s AND idempotency_key = %s
                     AND idempotency_key_expires_at <= coalesce(%s, now())""",
                (wp.env_id, wp.idempotency_key, now))
            for _ in range(3):  # each statement reads what was committed before it (read committed)
                await cur.execute(_INSERT_WAITPOINT, {"rows": Jsonb([row])})
                inserted = await cur.fetchone()
                if inserted is not None:
                    return _waitpoint(inserted), False
                await cur.execute("SELECT * FROM waitpoint WHERE environment_id = %s AND idempotency_key = %s",
                                  (wp.env_id, wp.idempotency_key))
                existing = await cur.fetchone()
                if existing is not None:
                    return _waitpoint(existing), True
        raise ConflictError("idempotencyKey", "the key kept changing hands while the waitpoint was made; retry")

    async def create_many(self, wps: Sequence[NewWaitpoint]) -> list[Waitpoint]:
        """Insert waitpoints that have no idempotency key, in one statement."""
        if any(wp.idempotency_key is not None for wp in wps):
            raise ValueError("create_many takes waitpoints without an idempotency key (see create)")
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(_INSERT_WAITPOINT, {"rows": Jsonb([to_columns(wp) for wp in wps])})
            found = {r["id"]: _waitpoint(r) for r in await cur.fetchall()}
        return [found[wp.id] for wp in wps]

    async def release_run_key(self, waitpoint_id: str, key: str) -> None:
        """Let go of the key of a completed RUN waitpoint (its run was reopened since: the next
        waiter gets a waitpoint of its own)."""
        async with self.pool.connection() as conn:
            await conn.execute("UPDATE waitpoint SET idempotency_key = NULL WHERE id = %s AND idempotency_key = %s"
                               " AND type = 'RUN' AND status = 'COMPLETED'", (waitpoint_id, key))

    async def get(self, waitpoint_id: str, env_id: str | None = None) -> Waitpoint | None:
        wp = (await self.get_many([waitpoint_id])).get(waitpoint_id)
        return wp if wp is not None and env_id in (None, wp.env_id) else None

    async def get_many(self, waitpoint_ids: Sequence[str]) -> dict[str, Waitpoint]:
        """The waitpoints of ``waitpoint_ids`` that exist, by id: one query."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute("SELECT * FROM waitpoint WHERE id = ANY(%s)", (list(waitpoint_ids),))
            return {wp.id: wp for wp in map(_waitpoint, await cur.fetchall())}

    async def list_tokens(self, env_id: str, *, statuses: Sequence[str] = (), timed_out: bool | None = None,
                          tags: Sequence[str] = (), idempotency_key: str | None = None,
                          created_from: datetime | None = None, created_to: datetime | None = None,
                          limit: int = 25, after: tuple[datetime, str] | None = None,
                          max_bytes: int = PAGE_BYTES, timeout_s: float | None = None) -> tuple[list[Waitpoint], bool]:
        """MANUAL waitpoints newest first; ``timed_out`` narrows COMPLETED ones by error output.
        Fewer than ``limit`` when their outputs pass ``max_bytes`` (as JSON text; at least one): the
        sizes are read first, then the tokens that fit. Returns them and whether more follow.
        ``timeout_s``: each statement's bound (:func:`bounded_read`; None: none)."""
        async with bounded_read(self.pool, timeout_s) as conn:
            cur = await conn.execute(_TOKEN_PAGE, {
                "env": env_id, "statuses": list(statuses) or None, "timed_out": timed_out,
                "tags": list(tags) or None, "key": idempotency_key, "from": created_from, "to": created_to,
                "after_ts": after[0] if after else None,
                "after_id": after[1] if after else None, "limit": limit + 1, "max_bytes": max_bytes})
            kept, more = walked_page(await cur.fetchall(), limit, max_bytes)
            whole = conn.cursor(row_factory=dict_row)
            await whole.execute("SELECT * FROM waitpoint WHERE id = ANY(%s) ORDER BY created_at DESC, id DESC", (kept,))
            return [_waitpoint(r) for r in await whole.fetchall()], more

    async def complete(self, completions: Sequence[Completion]) -> list[tuple[str, bool, int]]:
        """Complete pending waitpoints (first completion wins, of two in ``completions`` the
        earlier): (id, timed, position in ``completions``) of those actually completed;
        ``timed``: a timeout or a date of it has an engine job to cancel."""
        if not completions:
            return []
        rows = [{"ord": i, "id": c.id, "run_id": c.run_id, "output": c.output, "is_error": c.is_error,
                 "env_id": c.env_id} for i, c in enumerate(completions)]
        async with self.pool.connection() as conn:
            cur = await conn.execute(_COMPLETE, {"rows": Jsonb(rows)})
            return [(r[0], bool(r[1]), int(r[2])) for r in await cur.fetchall()]

    async def blocked_runs(self, waitpoint_ids: Sequence[str], *, after: str = "",
                           limit: int | None = None) -> list[str]:
        """The runs blocked on one of ``waitpoint_ids``, by id after ``after``, ``limit`` at most."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(_BLOCKED_RUNS, {"ids": list(waitpoint_ids), "after": after, "limit": limit})
            return [r[0] for r in await cur.fetchall()]

    async def environments_of(self, waitpoint_ids: Sequence[str]) -> dict[str, str]:
        """waitpoint id -> its environment id."""
        async with self.pool.connection() as conn:
            cur = await conn.execute("SELECT id, environment_id FROM waitpoint WHERE id = ANY(%s)",
                                     (list(waitpoint_ids),))
            return {r[0]: r[1] for r in await cur.fetchall()}

    # --- blocking -----------------------------------------------------------------------------

    async def block(self, run_id: str, waitpoint_ids: Sequence[str], journal: JournalEntry | None,
                    batch_index: int | None = None) -> tuple[JournalEntry | None, int]:
        """Block ``run_id`` on ``waitpoint_ids`` and journal the wait, in one transaction.

        Returns the journal entry already at that sequence when there was one (a replay re-blocks
        on it; a different entry means a duplicate execution), and the number of the run's
        waitpoints still pending, counted after the commit."""
        async with self.pool.connection() as conn:
            async with conn.transaction():
                cur = conn.cursor(row_factory=dict_row)
                existing = None
                if journal is not None:
                    existing = await self._insert_journal(cur, run_id, journal)
                if existing is None or existing.waitpoint_id in waitpoint_ids:
                    await cur.execute(
                        """INSERT INTO task_run_waitpoint (run_id, waitpoint_id, batch_index)
                           SELECT %s, unnest(%s::text[]), %s ON CONFLICT DO NOTHING""",
                        (run_id, list(waitpoint_ids), batch_index))
            pending = await self.pending_count(run_id, conn)
        return existing, pending

    async def block_executing(self, blocks: Sequence[BlockWrite]) -> list[Blocked]:
        """Journal, block and move EXECUTING runs to EXECUTING_WITH_WAITPOINTS, in one statement for
        all (see _BLOCK); the caller holds the runs' locks. A run whose place in the chain another
        writer took first is answered with its latest snapshot as it is now (nothing was written)."""
        if not blocks:
            return []
        if len({b.run_id for b in blocks}) != len(blocks):
            raise ValueError("block_executing: each run at most once per statement")
        rows = [{"run_id": b.run_id, "expected": b.expected_snapshot_id, "seq": b.entry.sequence,
                 "kind": b.entry.kind, "key": b.entry.key, "result": b.entry.result, "wp": b.entry.waitpoint_id,
                 "wps": list(b.waitpoint_ids), "new": b.new_snapshot_id, "description": b.description,
                 "checkpoint": b.suspend[0] if b.suspend else None, "suspend_new": b.suspend[1] if b.suspend else None,
                 "env": b.env_id}
                for b in blocks]
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(_BLOCK, {"rows": Jsonb(rows)})
            found = {row["run_id"]: row for row in await cur.fetchall()}
        out = []
        for b in blocks:
            row = found[b.run_id]
            if row["missing"]:
                out.append(Blocked(transition_result(b.run_id, row["latest_id"], row["latest_status"], None),
                                   None, False, 0, missing=True))
                continue
            if row["conflict"]:
                with committed():  # the others' writes stand
                    out.append(Blocked(await self._moved_on(b.run_id), None, False, 0))
                continue
            e = row["existing"]
            out.append(Blocked(
                transition_result(b.run_id, row["latest_id"], row["latest_status"], row),
                JournalEntry(e["sequence"], e["kind"], e["key"], e["result"], e["waitpoint_id"]) if e else None,
                bool(row["allowed"]), int(row["pending"] or 0),
                from_prefixed(Snapshot, row, "x")))
        return out

    async def suspend(self, suspends: Sequence[tuple[str, str, str, str]]) -> list[tuple[TransitionResult, int]]:
        """Checkpoint and suspend blocked runs, each (run id, expected snapshot id, checkpoint id, new
        snapshot id), in one statement (see _SUSPEND): per run, the transition's result and its pending
        waitpoints. The caller holds the runs' locks."""
        if not suspends:
            return []
        rows = [{"run_id": r, "expected": e, "checkpoint": c, "new": n} for r, e, c, n in suspends]
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(_SUSPEND, {"rows": Jsonb(rows)})
            found = {row["run_id"]: row for row in await cur.fetchall()}
        out = []
        for run_id, *_ in suspends:
            row = found[run_id]
            if row["conflict"]:  # another transition came first; nothing was written
                with committed():  # the others' writes stand
                    out.append((await self._moved_on(run_id), 0))
                continue
            out.append((transition_result(run_id, row["latest_id"], row["latest_status"], row), int(row["pending"])))
        return out

    async def pending_counts(self, run_ids: Sequence[str]) -> dict[str, int]:
        """The pending waitpoints of each run, in one query."""
        if not run_ids:
            return {}
        async with self.pool.connection() as conn:
            cur = await conn.execute(_PENDING_OF_RUNS, {"runs": list(run_ids)})
            return {r[0]: int(r[1]) for r in await cur.fetchall()}

    async def repoint(self, run_id: str, sequence: int, waitpoint_id: str | None, key: str, result: Any,
                      batch_shrink: tuple[str, int] | None = None) -> None:
        """After a child's idempotency key returned an existing run: the journal entry (and the RUN
        waitpoint, or the batch's size) name what the parent really waits on. One transaction."""
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute("UPDATE task_run_journal SET key = %s, result = %s, result_bytes = %s"
                               " WHERE run_id = %s AND sequence = %s",
                               (key, Jsonb(result), json_bytes(result), run_id, sequence))
            if waitpoint_id is not None:
                await conn.execute("UPDATE waitpoint SET completed_by_run_id = %s WHERE id = %s AND status = 'PENDING'",
                                   (key, waitpoint_id))
            if batch_shrink is not None:
                await conn.execute("UPDATE batch_task_run SET size = size - %s WHERE id = %s",
                                   (batch_shrink[1], batch_shrink[0]))

    async def pending_count(self, run_id: str, conn: Any = None) -> int:
        sql = "SELECT count(*) FROM task_run_waitpoint trw WHERE trw.run_id = %s AND " \
              + _IS_PENDING.format(id="trw.waitpoint_id")
        if conn is not None:
            cur = await conn.execute(sql, (run_id,))
            return _first_int(await cur.fetchone())
        async with self.pool.connection() as c:
            cur = await c.execute(sql, (run_id,))
            return _first_int(await cur.fetchone())

    async def blocking(self, run_id: str, limit: int = 100) -> list[Waitpoint]:
        """The pending waitpoints a run waits on."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                # each of the run's rows looked up by primary key (see _IS_PENDING)
                """SELECT w.* FROM task_run_waitpoint trw
                   CROSS JOIN LATERAL (SELECT * FROM waitpoint w WHERE w.id = trw.waitpoint_id OFFSET 0) w
                   WHERE trw.run_id = %s AND w.status = 'PENDING' ORDER BY w.created_at LIMIT %s""", (run_id, limit))
            return [_waitpoint(r) for r in await cur.fetchall()]

    async def continue_blocked(self, runs: Sequence[tuple[str, str]]) -> list[tuple[TransitionResult, bool]]:
        """Continue each (run id, new snapshot id) whose run is blocked and nothing blocks any more
        (see _CONTINUE), in one statement: per run, its result (applied with the new snapshot, or
        the latest snapshot as it was) and whether it lost its place to another writer."""
        if not runs:
            return []
        ordered = sorted(dict(runs).items())
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(_CONTINUE, {"runs": [r for r, _ in ordered], "news": [n for _, n in ordered]})
            rows = {row["run_id"]: row for row in await cur.fetchall()}
        return [(transition_result(run_id, rows[run_id]["latest_id"], rows[run_id]["latest_status"], rows[run_id]),
                 bool(rows[run_id]["conflict"]))
                for run_id, _ in ordered]

    async def _moved_on(self, run_id: str) -> TransitionResult:
        """A transition of the run that did not apply: its latest snapshot as it is now."""
        latest_id, latest_status, _ = await self.blocking_state(run_id)
        return transition_result(run_id, latest_id, latest_status, None)

    async def blocking_state(self, run_id: str) -> tuple[str | None, str | None, int]:
        """Latest valid snapshot id and status of the run, and its pending waitpoints: one query."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT s.id, s.engine_status,
                          """ + _PENDING_OF_RUN + """
                   FROM (SELECT 1) one
                   LEFT JOIN LATERAL (SELECT id, engine_status FROM task_run_execution_snapshot
                                      WHERE run_id = %(run)s AND is_valid ORDER BY seq DESC LIMIT 1) s ON true""",
                {"run": run_id})
            row = await cur.fetchone()
        assert row is not None
        return row[0], row[1], int(row[2])

    async def unblock(self, run_id: str) -> list[str]:
        """Remove the run's blocking rows (it continues); the waitpoint ids it was blocked on."""
        async with self.pool.connection() as conn:
            cur = await conn.execute("DELETE FROM task_run_waitpoint WHERE run_id = %s RETURNING waitpoint_id",
                                     (run_id,))
            return [r[0] for r in await cur.fetchall()]

    # --- journal and checkpoints --------------------------------------------------------------

    @staticmethod
    async def _insert_journal(cur: Any, run_id: str, entry: JournalEntry) -> JournalEntry | None:
        await cur.execute(
            """INSERT INTO task_run_journal (run_id, sequence, kind, key, result, waitpoint_id, result_bytes)
               VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING RETURNING sequence""",
            (run_id, entry.sequence, entry.kind, entry.key, Jsonb(entry.result), entry.waitpoint_id,
             json_bytes(entry.result)))
        if await cur.fetchone() is not None:
            return None
        await cur.execute("SELECT * FROM task_run_journal WHERE run_id = %s AND sequence = %s",
                          (run_id, entry.sequence))
        row = await cur.fetchone()
        return JournalEntry(row["sequence"], row["kind"], row["key"], row["result"], row["waitpoint_id"])

    async def append_journal(self, run_id: str, entry: JournalEntry) -> JournalEntry | None:
        """Journal a step result; ``None`` when inserted, else the entry that won the race."""
        async with self.pool.connection() as conn, conn.transaction():
            return await self._insert_journal(conn.cursor(row_factory=dict_row), run_id, entry)

    async def journal(self, run_id: str, from_sequence: int = 0) -> JournalPage:
        return (await self.journals([(run_id, from_sequence)]))[0]

    async def journals(self, wanted: Sequence[tuple[str, int]]) -> list[JournalPage]:
        """A page of the journal of each (run id, from sequence), with each wait's waitpoint: one
        query (see :func:`journal_page`)."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            # (a sequence is an integer column: a start past its range finds nothing, as it should)
            await cur.execute(_JOURNALS, {"runs": [r for r, _ in wanted],
                                          "froms": [max(0, min(f, _SEQUENCE_MAX)) for _, f in wanted]})
            found: dict[int, list[dict[str, Any]]] = {}
            for row in await cur.fetchall():
                found.setdefault(row.pop("ord"), []).append(row)
        return [journal_page_of(found.get(i, [])) for i in range(1, len(wanted) + 1)]

    async def timed_waitpoints_page(self, after_id: str, limit: int) -> list[tuple[str, str, str, datetime | None,
                                                                                datetime | None]]:
        """Pending waitpoints an engine job completes: (id, environment, type, completed_after, timeout_at)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT id, environment_id, type, completed_after, timeout_at FROM waitpoint
                   WHERE status = 'PENDING' AND id > %s
                     AND ((type = 'DATETIME' AND completed_after IS NOT NULL) OR timeout_at IS NOT NULL)
                   ORDER BY id LIMIT %s""", (after_id, limit))
            return [(r[0], r[1], r[2], r[3], r[4]) for r in await cur.fetchall()]

    async def runs_outside_batch(self, run_ids: Sequence[str], batch_id: str) -> list[str]:
        """Those of ``run_ids`` that exist and are not runs of ``batch_id`` (a batch item's key
        named a run made before: the parent waits on it beside the batch)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                "SELECT id FROM task_run WHERE id = ANY(%s) AND batch_id IS DISTINCT FROM %s ORDER BY id",
                (list(run_ids), batch_id))
            return [r[0] for r in await cur.fetchall()]

    async def still_orphaned(self, waitpoint_ids: Sequence[str]) -> tuple[set[str], dict[str, list[str]]]:
        """Of pending RUN and BATCH waitpoints the sweeper found without their runs: those still
        so (a RUN waitpoint's run not there, a batch short of runs), and the runs each blocks."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT w.id FROM waitpoint w WHERE w.id = ANY(%(ids)s) AND w.status = 'PENDING' AND (
                       (w.type = 'RUN'
                        AND NOT EXISTS (SELECT 1 FROM task_run r WHERE r.id = w.completed_by_run_id))
                    OR (w.type = 'BATCH'
                        AND (SELECT count(*) FROM task_run r WHERE r.batch_id = w.completed_by_batch_id)
                            < (SELECT b.size FROM batch_task_run b WHERE b.id = w.completed_by_batch_id)))""",
                {"ids": list(waitpoint_ids)})
            still = {r[0] for r in await cur.fetchall()}
            cur = await conn.execute(
                "SELECT waitpoint_id, run_id FROM task_run_waitpoint WHERE waitpoint_id = ANY(%s)",
                (list(waitpoint_ids),))
            blocked: dict[str, list[str]] = {}
            for wp_id, run_id in await cur.fetchall():
                blocked.setdefault(wp_id, []).append(run_id)
            return still, blocked

    async def existing_runs(self, run_ids: Sequence[str]) -> set[str]:
        """Which of ``run_ids`` exist."""
        async with self.pool.connection() as conn:
            cur = await conn.execute("SELECT id FROM task_run WHERE id = ANY(%s)", (list(run_ids),))
            return {r[0] for r in await cur.fetchall()}

    async def run_results(self, owner_run_id: str, batches: Sequence[Sequence[str]],
                          max_bytes: int = RESULTS_BYTES) -> tuple[dict[str, tuple[str, Any, Any]], set[str]]:
        """status, output, error of each run of ``batches`` (those of ``owner_run_id``'s environment
        only: whatever ids a journal entry holds, another tenant's runs are never read), and the runs
        whose output and error were left out: those of a batch, in its order, past ``max_bytes`` of
        them as JSON (measured first, in PostgreSQL): a parent that waited on a batch of a thousand
        3 MiB outputs must not take 3 GB of the memory every tenant shares. Per batch, so that a
        batch's results are the same whichever other entries of the journal are read with it."""
        ids = list(dict.fromkeys(rid for batch in batches for rid in batch))
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT id, coalesce(octet_length(output::text), 0) + coalesce(octet_length(error::text), 0)
                   FROM task_run WHERE id = ANY(%s)
                     AND environment_id = (SELECT environment_id FROM task_run WHERE id = %s)""",
                (ids, owner_run_id))
            sizes: dict[str, int] = {r[0]: r[1] for r in await cur.fetchall()}
            kept, over = [], set()
            for batch in batches:
                total = 0
                for rid in batch:
                    if rid not in sizes:
                        continue
                    total += sizes[rid]
                    if total > max_bytes:
                        over.add(rid)
                    else:
                        kept.append(rid)
            cur = await conn.execute("SELECT id, status, output, error FROM task_run WHERE id = ANY(%s)", (kept,))
            found = {r[0]: (r[1], r[2], r[3]) for r in await cur.fetchall()}
            if over:
                cur = await conn.execute("SELECT id, status FROM task_run WHERE id = ANY(%s)", (list(over),))
                found.update({r[0]: (r[1], None, None) for r in await cur.fetchall()})
            return found, over

    # --- batches ------------------------------------------------------------------------------

    async def count_finished_children(self, batch_counts: dict[str, int]) -> list[str]:
        """Add finished children to their batches; the batches now complete. One row update per
        batch; only when the sum reaches the batch's size (less its items that failed on their
        own, which have no run) are its finished children counted (a child that finished twice,
        dead-lettered then redriven, or was reported twice, was added twice): the batch completes
        if they are all there, else its sum becomes that count. The rows are locked first (in id
        order) and counted in a statement after: a count that waited behind another's for a row
        must read the runs that other count was for, whose finish its own snapshot, taken before
        it waited, would not hold (the batch was found short of them, for good)."""
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute("SELECT 1 FROM batch_task_run WHERE id = ANY(%s) ORDER BY id FOR UPDATE",
                               (list(batch_counts),))
            cur = await conn.execute(
                """UPDATE batch_task_run b SET
                       completed_count = CASE WHEN b.completed_count + i.n < b.size - b.items_failed
                                              THEN b.completed_count + i.n ELSE """ + _FINISHED_CHILDREN + """ END,
                       status = CASE WHEN b.completed_count + i.n >= b.size - b.items_failed
                                      AND """ + _FINISHED_CHILDREN + """ >= b.size - b.items_failed
                                     THEN 'COMPLETED' ELSE b.status END,
                       completed_at = CASE WHEN b.completed_count + i.n >= b.size - b.items_failed
                                            AND """ + _FINISHED_CHILDREN + """ >= b.size - b.items_failed
                                           THEN now() END
                   FROM (SELECT unnest(%s::text[]) AS id, unnest(%s::int[]) AS n) i
                   WHERE b.id = i.id AND b.status = 'PENDING' RETURNING b.id, b.status""",
                (list(batch_counts), list(batch_counts.values())))
            return [r[0] for r in await cur.fetchall() if r[1] == "COMPLETED"]

    async def batch_waitpoints(self, batch_ids: Sequence[str]) -> list[str]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(_BATCH_WAITPOINTS, {"batches": list(batch_ids)})
            return [r[0] for r in await cur.fetchall()]

    # --- the sweeper --------------------------------------------------------------------------

    async def sweep_candidates(self, *, grace_s: float, cursors: SweepCursors, walk: int = SWEEP_WALK,
                               limit: int = 500) -> tuple[dict[str, list[Any]], SweepCursors]:
        """What the sweeper repairs in this pass, and where its next pass goes on: the waiting runs
        and pending RUN waitpoints are walked ``walk`` at a time from ``cursors`` (back to the
        start after the last slice), so that a pass costs the same whatever one tenant keeps
        waiting; the pending BATCH waitpoints are read whole (``limit`` found at most)."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(_SWEEP_RUN_WAITPOINTS, {"after": cursors.waitpoints, "walk": walk, "grace_s": grace_s})
            walked = await cur.fetchall()
            finished = [r["id"] for r in walked if r["finished"]][:limit]
            orphans = [r["id"] for r in walked if r["orphaned"]]
            # the next slice starts after the last waitpoint this pass took care of (a finished run's
            # past `limit` waits for the next pass)
            last = walked[-1]["id"] if len(walked) == walk else ""
            if len(finished) == limit and finished[-1] != walked[-1]["id"]:
                last = finished[-1]
                orphans = [o for o in orphans if o <= last]
            runs: list[Any] = []
            if finished:
                await cur.execute(_FINISHED_RUNS_OF_WAITPOINTS, {"ids": finished})
                runs = await cur.fetchall()
            await cur.execute(_SWEEP_BATCHES, {"limit": limit, "grace_s": grace_s})
            batches = await cur.fetchall()
            await cur.execute(_SWEEP_STUCK_RUNS, {"after": cursors.runs, "walk": walk, "grace_s": grace_s})
            waiting = await cur.fetchall()
            stuck = [r["id"] for r in waiting if r["stuck"]]
        following = SweepCursors(runs=waiting[-1]["id"] if len(waiting) == walk else "", waitpoints=last)
        return {"run_waitpoints": runs, "batches": batches, "stuck_runs": stuck, "orphaned": orphans}, following


    async def open_batch(self, batch_id: str, env_id: str, size: int, idempotency_key: str | None, *,
                         expires_at: datetime | None = None, now: datetime | None = None,
                         two_phase: bool = True, made_by: str | None = None) -> tuple[str, int, bool]:
        """A batch (whose items come later, when ``two_phase``): (id, expected size, whether it
        existed: the same idempotency key answers with the batch it made before until the key
        ``expires_at``; a key expired at ``now`` is released first, as a run's is). ``made_by``:
        the identity of the credential that makes it (None: the environment's secret key), kept
        on a batch made now (a batch found keeps its own). A key let go between the insert that found
        it taken and the look-up of its batch (that batch's request failed before making a run,
        :meth:`release_empty_batch_key`, or a reset) is free: the insert is tried again."""
        async with self.pool.connection() as conn, conn.transaction():
            if idempotency_key is not None:
                await conn.execute(
                    """UPDATE batch_task_run SET idempotency_key = NULL, idempotency_key_expires_at = NULL
                       WHERE environment_id = %s AND idempotency_key = %s
                         AND idempotency_key_expires_at <= coalesce(%s, now())""", (env_id, idempotency_key, now))
            for _ in range(3):  # each statement reads what was committed before it (read committed)
                cur = await conn.execute(
                    """INSERT INTO batch_task_run (id, environment_id, size, idempotency_key,
                                                   idempotency_key_expires_at, two_phase, made_by)
                       VALUES (%s, %s, %s, %s, %s, %s, %s)
                       ON CONFLICT (environment_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
                       RETURNING id, size""", (batch_id, env_id, size, idempotency_key, expires_at, two_phase, made_by))
                row = await cur.fetchone()
                if row is not None:
                    return str(row[0]), int(row[1]), False
                cur = await conn.execute(
                    "SELECT id, size FROM batch_task_run WHERE environment_id = %s AND idempotency_key = %s",
                    (env_id, idempotency_key))
                found = await cur.fetchone()
                if found is not None:
                    return str(found[0]), int(found[1]), True
        raise ConflictError("idempotency-key", "the key kept changing hands while this batch was opened; retry")

    async def release_empty_batch_key(self, batch_id: str, env_id: str) -> bool:
        """Free the idempotency key of the environment's batch ``batch_id`` if no run is in it
        (the request that made it failed before any): whether it was freed."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """UPDATE batch_task_run SET idempotency_key = NULL, idempotency_key_expires_at = NULL
                   WHERE id = %s AND environment_id = %s AND idempotency_key IS NOT NULL
                     AND NOT EXISTS (SELECT 1 FROM task_run WHERE batch_id = %s)""", (batch_id, env_id, batch_id))
            return cur.rowcount > 0

    async def reset_batch_idempotency_key(self, env_id: str, key: str) -> int:
        """Free an idempotency key of the environment's batches whatever its TTL; how many held it."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                "UPDATE batch_task_run SET idempotency_key = NULL, idempotency_key_expires_at = NULL "
                "WHERE environment_id = %s AND idempotency_key = %s", (env_id, key))
            return cur.rowcount

    async def open_batch_items(self, batch_id: str, env_id: str) -> tuple[int, set[int]] | None:
        """A batch of the environment opened for its items to come later: its expected size and
        the indexes of the items triggered so far; None for a batch made in one request (it keeps no
        sent indexes: each line would be one more run of it), a run's batchTriggerAndWait batch (its
        parent waits for its own children) or none."""
        async with self.pool.connection() as conn:
            cur = await conn.execute("SELECT size, items_seen FROM batch_task_run WHERE id = %s AND environment_id = %s"
                                     " AND two_phase", (batch_id, env_id))
            row = await cur.fetchone()
            return None if row is None else (int(row[0]), set(row[1] or ()))

    async def batch_indexes_run(self, batch_id: str, indexes: Sequence[int]) -> set[int]:
        """Which of ``indexes`` of a streamed batch have a run of it (``task_run.batch_index``),
        whatever their task or key: made by a stream, noted or not (one that died before its note)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute("SELECT DISTINCT batch_index FROM task_run WHERE batch_id = %s"
                                     " AND batch_index = ANY(%s)", (batch_id, list(indexes)))
            return {int(r[0]) for r in await cur.fetchall()}

    async def batch_record(self, batch_id: str, env_id: str) -> BatchRecord | None:
        """The environment's batch as it was opened (or triggered in one request), or None."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute("SELECT size, two_phase, cardinality(items_seen) AS items_seen, idempotency_key, "
                              "parent_run_id, created_at, made_by, item_errors FROM batch_task_run "
                              "WHERE id = %s AND environment_id = %s", (batch_id, env_id))
            row = await cur.fetchone()
            if row is None:
                return None
            errors = row.pop("item_errors")
            return BatchRecord(**row, item_errors=tuple(
                BatchItemError.from_json(int(index), errors[index]) for index in sorted(errors, key=int)))

    async def note_batch_items(self, batch_id: str, indexes: Sequence[int],
                               failed: Mapping[int, BatchItemError] | None = None) -> int:
        """Record that the items at ``indexes`` of a batch were triggered and those of ``failed``
        failed on their own; how many of its indexes have been sent, with these. A failure is kept
        only for an index not sent before (triggered, or failed already: the first failure stays),
        so a retried stream changes nothing; a failure of an index that has a run of the batch
        (``task_run.batch_index``: made by a stream not noted yet) is not kept either, and an index
        of ``indexes`` (or one with a run) noted failed before (two overlapping streams: one failed
        it, the other made its run) is no longer a failure, so that no index is counted both as a
        run and as failed. The failures are counted (``items_failed``) and the
        batch completes, when its runs had all finished but for them, in one statement: they may
        come after its runs were made and counted as they finished (:meth:`count_finished_children`
        compares those with ``items_failed`` as it is then). The row is locked first, so that the
        statement reads every finish counted before it, and a count after it reads its
        ``items_failed``. (A batch a parent waits on, batchTriggerAndWait, is never noted: it has
        no failed item.)"""
        errors = {str(index): error.as_json() for index, error in (failed or {}).items()}
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute("SELECT 1 FROM batch_task_run WHERE id = %s FOR UPDATE", (batch_id,))
            cur = await conn.execute(_NOTE_BATCH_ITEMS, {"batch": batch_id, "made": list(indexes),
                                                         "failed": [int(i) for i in errors], "errors": Jsonb(errors)})
            return _first_int(await cur.fetchone())

    async def insert_batch(self, batch_id: str, env_id: str, size: int, parent_run_id: str | None = None) -> None:
        async with self.pool.connection() as conn:
            await conn.execute(
                "INSERT INTO batch_task_run (id, environment_id, size, parent_run_id) VALUES (%s, %s, %s, %s)",
                (batch_id, env_id, size, parent_run_id))


@record
class BatchItemError:
    """Why an item of a two-phase batch failed on its own (no run was made for it): the task it
    named, if any ("" when none could be read), the error's message and code (as an API error's)."""
    index: int
    task_id: str
    message: str
    code: str

    def as_json(self) -> dict[str, str]:
        return {"taskIdentifier": self.task_id, "error": self.message, "errorCode": self.code}

    @classmethod
    def from_json(cls, index: int, data: dict[str, str]) -> BatchItemError:
        return cls(index, data.get("taskIdentifier", ""), data.get("error", ""), data.get("errorCode", ""))


@record
class BatchRecord:
    """A batch's own row: the runs it will have (``size``), whether it was opened for its items to
    come later (two-phase) and how many of them it has been sent (its failed items among them), its
    idempotency key, the run that triggered it (a run's batchTriggerAndWait), when it was made, who
    made it (a keyed one-request batch made by a public or run token: that credential's identity;
    None for the secret key, or when unknown: made before it was kept, or by a process that does not
    keep it), and the items that failed on their own, by index."""
    size: int
    two_phase: bool
    items_seen: int
    idempotency_key: str | None
    parent_run_id: str | None
    created_at: datetime
    made_by: str | None
    item_errors: tuple[BatchItemError, ...]


def _first_int(row: tuple[Any, ...] | None) -> int:
    """The one number an aggregate query returns (it always returns a row)."""
    assert row is not None
    return int(row[0])
