"""Runs and their execution snapshots: the rows, the inserts and the one-statement transition.

The hot path is :meth:`RunRepository.transition_many`: one statement that, for many runs at once,
checks each run's latest valid snapshot against the caller's expectation, appends the new
snapshot and updates the run row. It runs in its own transaction (autocommit), so a state change
is one round trip and one commit, however many runs a batch carries.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg import AsyncConnection
from psycopg.errors import UniqueViolation
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from run_engine.batching import committed
from run_engine.db.bounded import bounded_read
from run_engine.db.rows import columns_of, from_prefixed, from_row, from_slice, select_as, to_columns
from run_engine.errors import ConflictError
from run_engine.records import evolve, record

log = logging.getLogger(__name__)


@record
class Snapshot:
    id: str
    run_id: str
    engine_status: str
    run_status: str
    attempt_number: int
    description: str
    previous_snapshot_id: str | None
    checkpoint_id: str | None
    worker_id: str | None
    completed_waitpoint_ids: list[str]
    is_valid: bool
    error: dict[str, Any] | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class BatchView:
    id: str
    runs: int
    finished: int
    completed: int
    created_at: datetime


@record
class RunRow:
    id: str
    env_id: str
    worker_group_id: str
    task_id: str
    payload: Any
    payload_type: str
    status: str
    queue: str
    concurrency_key: str | None
    priority_ms: int
    idempotency_key: str | None
    ttl_s: int | None
    delay_until: datetime | None
    tags: list[str]
    metadata: Any
    max_attempts: int | None
    retry: dict[str, Any] | None
    max_duration_s: int | None
    machine: str | None
    attempt_number: int
    output: Any
    output_type: str | None
    error: dict[str, Any] | None
    locked_to_deployment_id: str | None
    parent_run_id: str | None
    root_run_id: str | None
    depth: int
    batch_id: str | None
    trigger_function: str
    resume_parent_on_completion: bool
    created_at: datetime
    updated_at: datetime
    queued_at: datetime | None
    queue_timestamp: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    #: the version the run was triggered with (lockToVersion): locked to its deployment for good
    locked_to_version: str | None = None




#: the requests with an idempotency key a run's metadata remembers (``task_run.metadata_requests``):
#: enough for a client that sends one request at a time and tries it again until answered
METADATA_REQUESTS_KEPT = 8


@dataclass(frozen=True, slots=True)
class MetadataRequest:
    """A request that changes the metadata of run ``run_id`` (and its parent's, its root's) sent
    with an idempotency key: ``digest`` names its body (a key sent again with another body is a
    conflict, not a repeat)."""

    run_id: str
    key: str
    digest: str

    @property
    def entry(self) -> str:
        """As ``task_run.metadata_requests`` keeps it (the digest is hex: the first ``:`` ends it)."""
        return f"{self.digest}:{self.key}"

    def seen_in(self, entries: Sequence[str]) -> bool:
        """Whether ``entries`` hold this request; ``ConflictError`` if they hold its key with
        another body."""
        for entry in entries:
            digest, _, key = entry.partition(":")
            if key == self.key:
                if digest != self.digest:
                    raise ConflictError("Idempotency-Key", "names another request to this run's metadata "
                                                           "(a key is one request's: its tries send the same body)")
                return True
        return False


def run_row(row: dict[str, Any]) -> RunRow:
    return from_row(RunRow, row)


def snapshot_row(row: dict[str, Any]) -> Snapshot:
    return from_row(Snapshot, row)


@record
class Transition:
    """One requested state change of one run.

    Applied only if the run's latest valid snapshot has an ``engine_status`` in ``from_statuses``
    and, when ``expected_snapshot_id`` is given, that id.
    """

    run_id: str
    new_snapshot_id: str
    engine_status: str
    run_status: str
    from_statuses: tuple[str, ...]
    expected_snapshot_id: str | None = None
    description: str = ""
    attempt_delta: int = 0
    set_started: bool = False
    set_finished: bool = False
    reopen: bool = False  # clear finished_at, output, error and the TTL (DLQ redrive)
    output: Any = None
    output_type: str | None = None
    error: dict[str, Any] | None = None
    worker_id: str | None = None
    # the snapshot's checkpoint; PENDING_EXECUTING and QUEUED_EXECUTING carry the previous one's
    checkpoint_id: str | None = None
    completed_waitpoint_ids: tuple[str, ...] = ()
    # a start that resumes a checkpointed run (the latest snapshot has one) keeps its attempt
    resume_checkpoint: bool = False


@record
class DequeueStart:
    """A run to dequeue and start at once (:meth:`RunRepository.dequeue_and_start`)."""

    run_id: str
    pending_snapshot_id: str
    executing_snapshot_id: str
    worker_id: str | None = None


@record
class TransitionResult:
    """``applied`` with the new snapshot and run; otherwise the latest snapshot's id and status
    (``None`` when the run does not exist)."""

    run_id: str
    applied: bool
    latest_snapshot_id: str | None
    latest_status: str | None
    snapshot: Snapshot | None = None
    run: RunRow | None = None


#: each input row's latest valid snapshot as ``l`` (the input aliased ``i``)
#: a journal read returns its entries up to this many bytes of results and outputs (the entry that
#: passes it included: at least one) and this many entries; the executor asks for the rest when its
#: replay gets there (JOURNAL_PAGE)
JOURNAL_PAGE_BYTES = 16 * 1024 * 1024
JOURNAL_PAGE_ENTRIES = 1000


def journal_page(run_id: str, from_seq: str) -> str:
    """The entries of a journal page (a lateral subquery: ``run_id`` and ``from_seq`` are SQL of the
    outer row): the first JOURNAL_PAGE_ENTRIES + 1 entries from ``from_seq``, each with its
    waitpoint's state, ``delivered`` for those in the page (the entries before it took less than
    JOURNAL_PAGE_BYTES), and their result and output for those only: an entry past the page is
    never read whole. Sizes are those recorded when the value was written (migration 0027 records
    those of live runs written before); one without is counted by its stored size, never
    measured (detoasted) at each read."""
    size = ("coalesce(j.result_bytes, pg_column_size(j.result), 0)"
            " + coalesce(w.output_bytes, pg_column_size(w.output), 0)")
    return f"""(
    SELECT p.sequence, p.kind, p.key, CASE WHEN p.delivered THEN p.result END AS result, p.waitpoint_id,
           p.waitpoint_status, CASE WHEN p.delivered THEN p.waitpoint_output END AS waitpoint_output,
           p.waitpoint_output_is_error, p.delivered
    FROM (
        SELECT j.sequence, j.kind, j.key, j.result, j.waitpoint_id, w.status AS waitpoint_status,
               w.output AS waitpoint_output, coalesce(w.output_is_error, false) AS waitpoint_output_is_error,
               row_number() OVER (ORDER BY j.sequence) <= {JOURNAL_PAGE_ENTRIES}
               AND coalesce(sum({size}) OVER (ORDER BY j.sequence ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING),
                            0) < {JOURNAL_PAGE_BYTES} AS delivered
        FROM (SELECT * FROM task_run_journal j WHERE j.run_id = {run_id} AND j.sequence >= {from_seq}
              ORDER BY j.sequence LIMIT {JOURNAL_PAGE_ENTRIES + 1}) j
        LEFT JOIN waitpoint w ON w.id = j.waitpoint_id
    ) p)"""


LATEST_OF_INPUT = """    LEFT JOIN LATERAL (
        SELECT s.id, s.engine_status, s.attempt_number, s.checkpoint_id
        FROM task_run_execution_snapshot s
        WHERE s.run_id = i.run_id AND s.is_valid
        ORDER BY s.seq DESC
        LIMIT 1
    ) l ON true
"""

_TRANSITION_SQL = """
-- transition_many: per input row, append a snapshot if the latest valid one matches, update the run.
-- params: rows, a JSON array with one object per transition (see Transition); one orjson dump
-- is far cheaper than adapting fifteen parallel arrays
WITH input AS (
    SELECT * FROM jsonb_to_recordset(%(rows)s::jsonb) AS t(
        ord int, run_id text, new_id text, engine_status text, run_status text, froms text,
        expected text, description text, attempt_delta int, set_started bool, set_finished bool,
        reopen bool, output jsonb, output_type text, error jsonb, worker_id text, checkpoint_id text,
        completed text[], resume bool)
), latest AS (
    SELECT i.ord, i.run_id, i.new_id, i.engine_status, i.run_status, i.froms, i.expected, i.description,
           CASE WHEN i.resume AND l.checkpoint_id IS NOT NULL THEN 0 ELSE i.attempt_delta END AS attempt_delta,
           i.set_started, i.set_finished, i.reopen, i.output, i.output_type, i.error, i.worker_id,
           i.checkpoint_id, i.completed, i.resume,
           l.id AS latest_id, l.engine_status AS latest_status, l.attempt_number AS latest_attempt,
           l.checkpoint_id AS latest_checkpoint
    FROM input i
""" + LATEST_OF_INPUT + """), allowed AS (
    SELECT * FROM latest
    WHERE latest_id IS NOT NULL
      AND (expected IS NULL OR latest_id = expected)
      AND latest_status = ANY(string_to_array(froms, ','))
), ins AS (
    INSERT INTO task_run_execution_snapshot (
        id, run_id, engine_status, run_status, attempt_number, description,
        previous_snapshot_id, worker_id, error, checkpoint_id, completed_waitpoint_ids)
    SELECT new_id, run_id, engine_status, run_status, latest_attempt + attempt_delta, description,
           latest_id, worker_id, error,
           CASE WHEN engine_status IN ('PENDING_EXECUTING', 'QUEUED_EXECUTING') OR resume
                THEN coalesce(checkpoint_id, latest_checkpoint) ELSE checkpoint_id END,
           coalesce(completed, '{}')
    FROM allowed
    -- in run id order, as every statement that appends snapshots for many runs: two of them that
    -- want the same runs wait for each other in one order, never in a cycle (a deadlock)
    ORDER BY run_id, ord
    -- a concurrent transition appended after the same snapshot first: this one did not apply
    ON CONFLICT (previous_snapshot_id) WHERE is_valid AND previous_snapshot_id IS NOT NULL DO NOTHING
    RETURNING *
), applied AS MATERIALIZED (  -- computed once (inlined, it would be once per row)
    -- per new snapshot id, its input row's position and attempt step: one object, looked up by each
    -- inserted snapshot below. Never a join of two CTEs here: the planner expects one row of each
    -- (and must, to look the runs up by primary key) and joins them by a nested loop, n^2 rows read
    -- (50 ms of a 200-run statement's 85)
    SELECT jsonb_object_agg(new_id, jsonb_build_array(ord, attempt_delta)) AS m FROM allowed
), upd AS (
    UPDATE task_run r SET
        status = ins.run_status,
        updated_at = clock_timestamp(),
        attempt_number = r.attempt_number + (applied.m -> ins.id ->> 1)::int,
        started_at = CASE WHEN a.set_started THEN coalesce(r.started_at, now()) ELSE r.started_at END,
        finished_at = CASE WHEN a.set_finished THEN now() WHEN a.reopen THEN NULL ELSE r.finished_at END,
        output = CASE WHEN a.reopen THEN NULL WHEN a.output IS NOT NULL THEN a.output ELSE r.output END,
        output_type = CASE WHEN a.output IS NOT NULL THEN a.output_type ELSE r.output_type END,
        error = CASE WHEN a.reopen THEN NULL WHEN ins.error IS NOT NULL THEN ins.error ELSE r.error END,
        -- a run redriven from the DLQ is to run: its TTL (counted from its creation) is over
        ttl_s = CASE WHEN a.reopen THEN NULL ELSE r.ttl_s END,
        queued_at = CASE WHEN ins.engine_status = 'QUEUED' THEN now() ELSE r.queued_at END
    FROM ins CROSS JOIN applied
    CROSS JOIN LATERAL jsonb_to_record(%(rows)s::jsonb -> (applied.m -> ins.id ->> 0)::int) AS a(
        set_started bool, set_finished bool, reopen bool, output jsonb, output_type text)
    WHERE r.id = ins.run_id
    RETURNING r.*
)
SELECT l.run_id AS t_run_id, l.latest_id AS t_latest_id, l.latest_status AS t_latest_status,
       (ins.id IS NULL AND EXISTS (SELECT 1 FROM allowed a WHERE a.ord = l.ord)) AS t_conflict,
       """ + select_as("ins", Snapshot, "s") + """,
       """ + select_as("upd", RunRow, "r") + """
FROM latest l
LEFT JOIN ins ON ins.id = l.new_id
LEFT JOIN upd ON upd.id = l.run_id AND ins.id IS NOT NULL
ORDER BY l.ord
"""

_DEQUEUE_START_SQL = """
-- dequeue_and_start: per input row, a dequeued run's PENDING_EXECUTING snapshot, its attempt's
-- EXECUTING snapshot appended after it and the run row updated once: one statement, one commit,
-- both snapshots kept. The checks and changes are transition_many's for the two transitions
-- (from QUEUED or QUEUED_EXECUTING; a run restored from a checkpoint resumes its attempt).
WITH input AS (
    SELECT * FROM jsonb_to_recordset(%(rows)s::jsonb) AS t(
        ord int, run_id text, pending_id text, executing_id text, worker_id text)
), latest AS (
    SELECT i.ord, i.run_id, i.pending_id, i.executing_id, i.worker_id,
           l.id AS latest_id, l.engine_status AS latest_status, l.attempt_number AS latest_attempt,
           l.checkpoint_id AS latest_checkpoint
    FROM input i
""" + LATEST_OF_INPUT + """), allowed AS (
    SELECT * FROM latest WHERE latest_status IN ('QUEUED', 'QUEUED_EXECUTING')
), ids AS MATERIALIZED (  -- each run's executing snapshot id by its pending one's, computed once
    SELECT jsonb_object_agg(x ->> 'pending_id', x -> 'executing_id') AS m FROM jsonb_array_elements(%(rows)s::jsonb) x
), pending AS (
    INSERT INTO task_run_execution_snapshot (
        id, run_id, engine_status, run_status, attempt_number, description, previous_snapshot_id, worker_id,
        checkpoint_id)
    SELECT pending_id, run_id, 'PENDING_EXECUTING', 'DEQUEUED', latest_attempt, %(pending_description)s, latest_id,
           worker_id, latest_checkpoint
    FROM allowed
    ORDER BY run_id, ord  -- run id order: see _TRANSITION_SQL
    -- a concurrent transition appended after the same snapshot first: this run is not dequeued
    ON CONFLICT (previous_snapshot_id) WHERE is_valid AND previous_snapshot_id IS NOT NULL DO NOTHING
    RETURNING *
), executing AS (
    INSERT INTO task_run_execution_snapshot (
        id, run_id, engine_status, run_status, attempt_number, description, previous_snapshot_id, worker_id,
        checkpoint_id)
    -- from the pending snapshot alone (its attempt, worker and checkpoint are the run's), the
    -- executing id by the pending one: never a join of two CTEs (see _TRANSITION_SQL's `applied`)
    SELECT ids.m ->> p.id, p.run_id, 'EXECUTING', 'EXECUTING',
           p.attempt_number + CASE WHEN p.checkpoint_id IS NULL THEN 1 ELSE 0 END,
           %(start_description)s, p.id, p.worker_id, p.checkpoint_id
    FROM pending p CROSS JOIN ids
    ORDER BY p.run_id, p.id
    RETURNING *
), upd AS (
    UPDATE task_run r SET
        status = 'EXECUTING',
        updated_at = clock_timestamp(),
        attempt_number = r.attempt_number + CASE WHEN e.checkpoint_id IS NULL THEN 1 ELSE 0 END,
        started_at = coalesce(r.started_at, now())
    FROM executing e
    WHERE r.id = e.run_id
    RETURNING r.*
)
SELECT l.run_id AS t_run_id, l.latest_id AS t_latest_id, l.latest_status AS t_latest_status,
       (p.id IS NULL AND EXISTS (SELECT 1 FROM allowed a WHERE a.ord = l.ord)) AS t_conflict,
       -- a run restored from its checkpoint, or retried, replays its journal: each entry with its
       -- waitpoint's state (what WaitpointRepository.journals reads), in the same round trip
       -- (its first page: the executor asks for the rest when its replay gets there)
       CASE WHEN e.id IS NOT NULL AND (e.checkpoint_id IS NOT NULL OR e.attempt_number > 1) THEN coalesce((
           SELECT jsonb_agg(to_jsonb(j) ORDER BY j.sequence) FROM """ + journal_page("l.run_id", "0") + """ j),
           '[]'::jsonb) END AS t_journal,
       -- read back by position (HEAD, then each block: rows.from_slice)
       """ + select_as("p", Snapshot, "p") + """,
       """ + select_as("e", Snapshot, "e") + """,
       """ + select_as("upd", RunRow, "r") + """
FROM latest l
LEFT JOIN pending p ON p.id = l.pending_id
LEFT JOIN executing e ON e.id = l.executing_id
LEFT JOIN upd ON upd.id = l.run_id AND e.id IS NOT NULL
ORDER BY l.ord
"""

_DROP_ORPHANS = """
-- snapshots appended by a statement to runs deleted meanwhile (their delete's trigger had run)
DELETE FROM task_run_execution_snapshot s WHERE s.id = ANY(%s)
  AND NOT EXISTS (SELECT 1 FROM task_run r WHERE r.id = s.run_id)
"""

_LATEST_OF_RUNS = """
-- the latest valid snapshot of each run (after a transition lost a race, to report what won)
SELECT DISTINCT ON (run_id) run_id, id, engine_status FROM task_run_execution_snapshot
WHERE run_id = ANY(%s) AND is_valid ORDER BY run_id, seq DESC
"""

#: a page of whole runs holds at most this much payload, output, metadata and error (JSON text;
#: at least one run): hundred runs of 3 MiB payloads would be 300 MiB, and more as Python objects
PAGE_BYTES = 16 * 1024 * 1024
#: a run row without the columns that may be megabytes (payload, output, metadata, error)
_HEAVY = {"payload", "output", "metadata", "error"}
_LIGHT_RUN = ", ".join(f"NULL AS {c}" if c in _HEAVY else c for _, c in columns_of(RunRow))
#: the columns of a run without its payload, output, metadata and error (NULL in their place)
LIGHT_RUN_COLUMNS = _LIGHT_RUN
#: what a run's heavy columns take as JSON text, the measure of a page of whole runs
_RUN_BYTES = ("coalesce(octet_length(payload::text), 0) + coalesce(octet_length(output::text), 0) "
              "+ coalesce(octet_length(metadata::text), 0) + coalesce(octet_length(error::text), 0)")

#: the environment's newest runs a tag shape's first read walks before it asks the tag's index
SHAPE_WALK_ROWS = 5000
#: a tag shape's first read by walking (:meth:`RunRepository._shape_walk`): one row at least (its
#: run columns NULL when nothing matched), each with how many runs were walked and the snapshot's
#: xmin; the walk is fenced by its LIMIT (never flattened into a plan by the tag's index)
_SHAPE_WALK = f"""
WITH walk AS MATERIALIZED (  -- narrow: the run's columns are read for the hits only
    SELECT id, created_at, tags && %(tags)s::text[] AS tagged FROM task_run
    WHERE environment_id = %(env)s AND (%(from)s::timestamptz IS NULL OR created_at >= %(from)s)
      AND (cardinality(%(tasks)s::text[]) = 0 OR task_identifier = ANY(%(tasks)s::text[]))
    ORDER BY created_at DESC, id DESC LIMIT %(walk)s
), hit AS MATERIALIZED (
    SELECT id FROM walk WHERE tagged ORDER BY created_at DESC, id DESC LIMIT %(limit)s
)
SELECT r.*, c.walked, c.walk_snapshot_xmin
FROM (SELECT count(*) AS walked, pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS walk_snapshot_xmin
      FROM walk) c
LEFT JOIN LATERAL (
    SELECT {_LIGHT_RUN}, xmin::text::bigint AS row_xmin FROM task_run WHERE id IN (SELECT id FROM hit)
) r ON true
ORDER BY r.created_at DESC, r.id DESC
"""
_WALK_EXTRA = frozenset({"row_xmin", "walked", "walk_snapshot_xmin"})

#: what one run adds to a realtime answer, measured: its payload and output sizes as JSON text when
#: each is stored in under %(item)s bytes and ``{go}`` holds (else NULL: not measured), and what its
#: metadata and cut error take (always sent inline). Found by its id alone (the primary key: a run
#: of another environment measures as nothing), and LIMIT 1 keeps it a lookup per run: flattened
#: into a join, a planner short of statistics measured every run of the environment at every step
_MEASURE = """SELECT CASE WHEN NOT ({go} AND %(payload)s) THEN NULL WHEN pg_column_size(t.payload) < %(item)s
                THEN octet_length(t.payload::text) END AS pb,
           CASE WHEN NOT ({go} AND %(output)s) THEN NULL WHEN pg_column_size(t.output) < %(item)s
                THEN octet_length(t.output::text) END AS ob,
           CASE WHEN %(metadata)s THEN coalesce(octet_length(t.metadata::text), 0) ELSE 0 END
           + CASE WHEN t.error IS NULL OR NOT %(error)s THEN 0 ELSE 1024
               + coalesce(octet_length(left(t.error ->> 'message', %(chars)s)), 0)
               + coalesce(octet_length(left(t.error ->> 'stackTrace', %(chars)s)), 0) END AS fb
    FROM (SELECT * FROM task_run t WHERE t.id = w.id LIMIT 1) t WHERE t.environment_id = %(env)s"""
#: what a run adds to an answer's inline bytes: its payload and output that are small enough
_INLINE = ("(CASE WHEN m.pb < %(item)s THEN m.pb ELSE 0 END + CASE WHEN m.ob < %(item)s THEN m.ob ELSE 0 END)")
#: a run's error as a shape stream sends it: the message and stack trace cut to this many characters
#: (name and type to 256): an error may be megabytes, and a realtime answer holds up to 1,000 runs
SHAPE_ERROR_CHARS = 8 * 1024
_RUN_PACKETS = """
-- the payload, output, metadata and error of the first runs asked for (in the order asked) that
-- one realtime answer holds. A payload or output goes inline as JSON text when it is under %(item)s
-- bytes and the inline ones so far, this run's included, stay within %(budget)s; any other one is
-- only flagged (the client fetches it by reference). Metadata and the cut error always go inline:
-- the answer ends before the run that takes it past %(answer)s bytes (the first run is always in
-- it; the client asks again for the rest). Sizes are measured a run at a time; payloads and
-- outputs no more once the inline budget or %(work)s bytes of measuring are spent (the runs after
-- send theirs by reference); a value stored in %(item)s bytes or more (compressed) is never turned
-- into text to be measured. A run that is not there takes no bytes and comes back without an id.
-- A column the client left out (%(payload)s... false) is neither measured nor read.
WITH RECURSIVE wanted AS MATERIALIZED (
    SELECT i.id, i.ord FROM unnest(%(ids)s::text[]) WITH ORDINALITY AS i(id, ord)
), walk AS (
    SELECT w.ord, m.pb, m.ob, """ + _INLINE + """ AS inline, coalesce(m.pb, 0) + coalesce(m.ob, 0) AS work,
           """ + _INLINE + """ + coalesce(m.fb, 0) AS total
    FROM wanted w LEFT JOIN LATERAL (""" + _MEASURE.format(go="true") + """) m ON true
    WHERE w.ord = 1
    UNION ALL
    SELECT w.ord, m.pb, m.ob, k.inline + """ + _INLINE + """, k.work + coalesce(m.pb, 0) + coalesce(m.ob, 0),
           k.total + """ + _INLINE + """ + coalesce(m.fb, 0)
    FROM walk k JOIN wanted w ON w.ord = k.ord + 1
    LEFT JOIN LATERAL (""" + _MEASURE.format(go="k.inline <= %(budget)s AND k.work <= %(work)s") + """) m ON true
    WHERE k.total <= %(answer)s
)
SELECT r.id,
       CASE WHEN k.inline <= %(budget)s AND k.pb < %(item)s THEN r.payload::text END, r.payload IS NOT NULL,
       CASE WHEN k.inline <= %(budget)s AND k.ob < %(item)s THEN r.output::text END, r.output IS NOT NULL,
       CASE WHEN %(metadata)s THEN r.metadata::text END,
       CASE WHEN r.error IS NOT NULL AND %(error)s THEN jsonb_build_object(
           'name', left(r.error ->> 'name', 256), 'type', left(r.error ->> 'type', 256),
           'message', left(r.error ->> 'message', %(chars)s),
           'stackTrace', left(r.error ->> 'stackTrace', %(chars)s))
       END,
       k.work
FROM walk k JOIN wanted w ON w.ord = k.ord
LEFT JOIN task_run r ON r.id = w.id AND r.environment_id = %(env)s
WHERE k.ord = 1 OR k.total <= %(answer)s
ORDER BY k.ord
"""


#: one run's payload or output as JSON text (what a packet URL answers with)
_PACKET_TEXT = {field: f"SELECT {field}::text FROM task_run WHERE id = %s AND environment_id = %s"
                for field in ("payload", "output")}


@record
class RunPackets:
    """A run's payload, output, metadata and error as a realtime shape sends them
    (:meth:`RunRepository.run_packets`): JSON text inline, or ``None`` with ``*_stored`` when the
    run has one that the client fetches by reference."""
    payload: str | None
    payload_stored: bool
    output: str | None
    output_stored: bool
    metadata: str | None
    error: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class ShapeRead:
    """The runs of a realtime shape as one statement read them (:meth:`RunRepository.shape_runs`):
    light runs, the transaction that wrote each one's row (by id), and the oldest transaction still
    running when they were read (None when no run was read)."""
    runs: list[RunRow]
    xmins: dict[str, int]
    snapshot_xmin: int | None


def page_walk(table: str, where: str, bytes_sql: str) -> str:
    """A page of ``table``'s rows bounded in bytes, measured: the candidates' ids in page order
    (newest first, at most %(limit)s), then each one's ``bytes_sql`` (what its large columns take as
    JSON text) added up one row at a time, stopping at the first row past %(max_bytes)s: a hundred
    3 MiB payloads are not all turned into text to keep five. Each row measured by its key alone
    (LIMIT 1: never flattened into a join that measures the whole table). Rows: id, its bytes, how
    many candidates there were."""
    return f"""
WITH RECURSIVE candidate AS MATERIALIZED (
    SELECT id, row_number() OVER (ORDER BY created_at DESC, id DESC) AS n
    FROM (SELECT id, created_at FROM {table} WHERE {where}
          ORDER BY created_at DESC, id DESC LIMIT %(limit)s) c
), walk AS (
    SELECT c.n, c.id, s.bytes, s.bytes AS total
    FROM candidate c CROSS JOIN LATERAL (SELECT {bytes_sql} AS bytes FROM {table} WHERE id = c.id LIMIT 1) s
    WHERE c.n = 1
    UNION ALL
    SELECT c.n, c.id, s.bytes, w.total + s.bytes
    FROM walk w JOIN candidate c ON c.n = w.n + 1
    CROSS JOIN LATERAL (SELECT {bytes_sql} AS bytes FROM {table} WHERE id = c.id LIMIT 1) s
    WHERE w.total <= %(max_bytes)s
)
SELECT id, bytes, (SELECT count(*) FROM candidate) FROM walk ORDER BY n
"""


_RUN_SIZE = f"LEFT JOIN LATERAL (SELECT {_RUN_BYTES} AS bytes FROM (SELECT * FROM task_run WHERE id = w.id " \
            "LIMIT 1) r WHERE environment_id = %(env)s) s ON true"
#: the sizes of given runs in their order (RunRepository.run_sizes), stopping one run past
#: %(max_bytes)s; a run not there measures as NULL and adds nothing
_SIZES_WALK = f"""
WITH RECURSIVE wanted AS MATERIALIZED (
    SELECT i.id, i.n FROM unnest(%(ids)s::text[]) WITH ORDINALITY AS i(id, n)
), walk AS (
    SELECT w.n, w.id, s.bytes, coalesce(s.bytes, 0) AS total FROM wanted w {_RUN_SIZE} WHERE w.n = 1
    UNION ALL
    SELECT w.n, w.id, s.bytes, k.total + coalesce(s.bytes, 0)
    FROM walk k JOIN wanted w ON w.n = k.n + 1 {_RUN_SIZE}
    WHERE k.total <= %(max_bytes)s
)
SELECT id, bytes FROM walk ORDER BY n
"""


def walked_page(walked: Sequence[tuple[str, int, int]], limit: int, max_bytes: int) -> tuple[list[str], bool]:
    """The ids a :func:`page_walk` keeps (at least one) and whether more candidates follow them."""
    kept = within_bytes([(item_id, size) for item_id, size, _ in walked[:limit]], max_bytes)
    return kept, (walked[0][2] if walked else 0) > len(kept)


#: the columns before the snapshot and run blocks of _TRANSITION_SQL's and _DEQUEUE_START_SQL's rows
_TRANSITION_HEAD, _DEQUEUE_HEAD = 4, 5
_SNAPSHOT_COLUMNS = len(columns_of(Snapshot))

#: runs with their latest valid snapshots, by run id (engine jobs about many runs at once)
_RUNS_WITH_LATEST_SQL = """
SELECT """ + select_as("s", Snapshot, "s") + """, """ + select_as("r", RunRow, "r") + """
FROM task_run r
CROSS JOIN LATERAL (SELECT * FROM task_run_execution_snapshot
                    WHERE run_id = r.id AND is_valid ORDER BY seq DESC LIMIT 1) s
WHERE r.id = ANY(%s)
"""

#: the unique index that keeps a run's snapshots one chain (migrations/0013_snapshot_chain.sql)
CHAIN_INDEX = "snapshot_chain_uq"


def chain_conflict(exc: BaseException) -> bool:
    """Whether ``exc`` is a snapshot appended after one that another transition appended after first."""
    return isinstance(exc, UniqueViolation) and exc.diag.constraint_name == CHAIN_INDEX


def within_bytes(sized: Sequence[tuple[str, int]], max_bytes: int) -> list[str]:
    """The ids of the first (id, bytes) whose bytes add up to at most ``max_bytes``, and at
    least the first: a page bounded in bytes."""
    kept: list[str] = []
    total = 0
    for item_id, size in sized:
        total += size
        if kept and total > max_bytes:
            break
        kept.append(item_id)
    return kept


def transition_result(run_id: str, latest_id: str | None, latest_status: str | None,
                      row: Mapping[str, Any] | None) -> TransitionResult:
    """A transition statement's answer for one run: the new snapshot and run (``row``'s columns
    ``s.*`` and ``r.*``, see :func:`select_as`) when it applied, else the latest snapshot's id and
    status (``None``: no such run)."""
    snapshot = from_prefixed(Snapshot, row, "s") if row is not None else None
    run = from_prefixed(RunRow, row, "r") if row is not None else None
    if snapshot is not None and run is not None:
        return TransitionResult(run_id=run_id, applied=True, latest_snapshot_id=snapshot.id,
                                latest_status=snapshot.engine_status, snapshot=snapshot, run=run)
    if snapshot is not None:  # the run was deleted while the statement appended to it: gone
        log.warning("run %s: snapshot %s appended but no run row updated (deleted meanwhile?): answered as gone",
                    run_id, snapshot.id)
        return TransitionResult(run_id=run_id, applied=False, latest_snapshot_id=None, latest_status=None)
    return TransitionResult(run_id=run_id, applied=False, latest_snapshot_id=latest_id, latest_status=latest_status)


@record
class NewRun:
    """A run to insert together with its first snapshot."""

    id: str
    snapshot_id: str
    env_id: str
    worker_group_id: str
    task_id: str
    payload: Any
    payload_type: str
    status: str
    engine_status: str
    queue: str
    concurrency_key: str | None = None
    priority_ms: int = 0
    idempotency_key: str | None = None
    idempotency_key_expires_at: datetime | None = None
    ttl_s: int | None = None
    delay_until: datetime | None = None
    tags: tuple[str, ...] = ()
    metadata: Any = None
    max_attempts: int | None = None
    retry: dict[str, Any] | None = None
    max_duration_s: int | None = None
    machine: str | None = None
    locked_to_deployment_id: str | None = None
    parent_run_id: str | None = None
    root_run_id: str | None = None
    depth: int = 0
    batch_id: str | None = None
    trigger_function: str = "trigger"
    resume_parent_on_completion: bool = False
    queue_timestamp: datetime | None = None
    description: str = "Run was created"
    debounce_key: str | None = None  # while the run is DELAYED, triggers with this key join it
    debounce_deadline: datetime | None = None  # the latest date those triggers may push it to
    locked_to_version: str | None = None  # lockToVersion: the run is its deployment's only
    batch_index: int | None = None  # the index of its streamed batch it was made as (migration 0053)


#: what must hold for runs to be inserted, checked (and written) in the insert's transaction
InsertGuard = Callable[[AsyncConnection[Any]], Awaitable[None]]

_INSERT_RUNS_TEMPLATE = """
-- insert_runs: many runs and their first snapshots in one statement.
WITH input AS (
    SELECT * FROM jsonb_to_recordset(%(rows)s::jsonb) AS t(
        id text, snapshot_id text, environment_id text, worker_group_id text, task_identifier text,
        payload jsonb, payload_type text, status text, engine_status text, queue text,
        concurrency_key text, priority_ms bigint, idempotency_key text,
        idempotency_key_expires_at timestamptz, ttl_s int, delay_until timestamptz, tags text[],
        metadata jsonb, max_attempts int, retry jsonb, max_duration_s int, machine text,
        locked_to_deployment_id text, parent_run_id text, root_run_id text, depth int,
        batch_id text, trigger_function text, resume_parent_on_completion bool,
        queue_timestamp timestamptz, description text, debounce_key text, debounce_deadline timestamptz,
        locked_to_version text, batch_index int)
), runs AS (
    INSERT INTO task_run (
        id, environment_id, worker_group_id, task_identifier, payload, payload_type, status, queue,
        concurrency_key, priority_ms, idempotency_key, idempotency_key_expires_at, ttl_s,
        delay_until, tags, metadata, max_attempts, retry, max_duration_s, machine,
        locked_to_deployment_id, parent_run_id, root_run_id, depth, batch_id, trigger_function,
        resume_parent_on_completion, queued_at, queue_timestamp, debounce_key, debounce_deadline,
        locked_to_version, batch_index)
    SELECT id, environment_id, worker_group_id, task_identifier, payload, payload_type, status, queue,
        concurrency_key, priority_ms, idempotency_key, idempotency_key_expires_at, ttl_s,
        delay_until, coalesce(tags, '{}'), metadata, max_attempts, retry, max_duration_s, machine,
        locked_to_deployment_id, parent_run_id, root_run_id, depth, batch_id, trigger_function,
        coalesce(resume_parent_on_completion, false), CASE WHEN engine_status = 'QUEUED' THEN now() END,
        coalesce(queue_timestamp, now()), debounce_key, debounce_deadline, locked_to_version, batch_index
    FROM input
    /*conflict*/
    RETURNING id, created_at
)
INSERT INTO task_run_execution_snapshot (id, run_id, engine_status, run_status, description)
SELECT i.snapshot_id, i.id, i.engine_status, i.status, i.description
FROM input i JOIN runs r ON r.id = i.id
RETURNING run_id
"""
# the idempotency key's index only: any other conflict is an error
_INSERT_RUNS_SQL = _INSERT_RUNS_TEMPLATE.replace(
    "/*conflict*/",
    "ON CONFLICT (environment_id, task_identifier, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING")
# debounced runs: the idempotency key's index or the debounce key's (task_run_debounce_uq)
_INSERT_DEBOUNCED_RUNS_SQL = _INSERT_RUNS_TEMPLATE.replace("/*conflict*/", "ON CONFLICT DO NOTHING")

_DEBOUNCE_SQL = """
-- debounce_delayed: a trigger joins a DELAYED run by its debounce key (under the run lock)
UPDATE task_run SET
    delay_until = least(%(when)s::timestamptz, coalesce(debounce_deadline, %(when)s::timestamptz)),
    queue_timestamp = least(%(when)s::timestamptz, coalesce(debounce_deadline, %(when)s::timestamptz)),
    payload = CASE WHEN %(replace)s THEN %(payload)s::jsonb ELSE payload END,
    payload_type = CASE WHEN %(replace)s THEN %(payload_type)s::text ELSE payload_type END,
    metadata = coalesce(%(metadata)s::jsonb, metadata),
    -- new metadata from a trigger is the run's seed again (migration 0050)
    seed_metadata = CASE WHEN %(metadata)s::jsonb IS NULL THEN seed_metadata END,
    tags = coalesce(%(tags)s::text[], tags),
    max_attempts = coalesce(%(max_attempts)s::int, max_attempts),
    max_duration_s = coalesce(%(max_duration_s)s::int, max_duration_s),
    machine = coalesce(%(machine)s::text, machine),
    updated_at = clock_timestamp()
WHERE id = %(id)s AND status = 'DELAYED' AND debounce_key IS NOT NULL
RETURNING *
"""


@dataclass(frozen=True, slots=True)
class DebounceReplacement:
    """What a trailing debounce replaces on the run it joins: the payload always, the others when
    the trigger gives them (``None``: keep)."""

    payload: Any
    payload_type: str
    metadata: Any = None
    tags: tuple[str, ...] | None = None
    max_attempts: int | None = None
    max_duration_s: int | None = None
    machine: str | None = None


class RunRepository:
    """Runs, snapshots, tags, metadata and the run list."""

    def __init__(self, pool: AsyncConnectionPool) -> None:
        self.pool = pool

    async def insert_runs(self, runs: Sequence[NewRun], *, debounced: bool = False,
                          guard: InsertGuard | None = None) -> set[str]:
        """Insert runs with their first snapshots; the ids inserted. A run whose idempotency key
        (environment, task, key) is taken is skipped: see :meth:`runs_by_idempotency_key`; with
        ``debounced``, also a run whose debounce key a DELAYED run holds (:meth:`delayed_run_by_debounce_key`).
        With ``guard``, the insert is in a transaction that ``guard`` begins (what it raises rolls
        it back and is raised)."""
        rows = [to_columns(r) for r in runs]
        async with self.pool.connection() as conn:
            if guard is None:
                cur = await conn.execute(_INSERT_DEBOUNCED_RUNS_SQL if debounced else _INSERT_RUNS_SQL,
                                         {"rows": Jsonb(rows)})
                return {r[0] for r in await cur.fetchall()}
            async with conn.transaction():
                await guard(conn)
                cur = await conn.execute(_INSERT_DEBOUNCED_RUNS_SQL if debounced else _INSERT_RUNS_SQL,
                                         {"rows": Jsonb(rows)})
                return {r[0] for r in await cur.fetchall()}

    async def delayed_run_by_debounce_key(self, env_id: str, task_id: str, key: str) -> RunRow | None:
        """The DELAYED run holding a debounce key (there is at most one: task_run_debounce_uq)."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT * FROM task_run WHERE environment_id = %s AND task_identifier = %s
                     AND debounce_key = %s AND status = 'DELAYED'""", (env_id, task_id, key))
            row = await cur.fetchone()
        return run_row(row) if row else None

    async def debounce_delayed(self, run_id: str, when: datetime,
                               replacement: DebounceReplacement | None = None) -> RunRow | None:
        """Move a debounced DELAYED run's date (and place in the queue) to ``when``, never past its
        debounce deadline, and apply a trailing debounce's ``replacement``; None (nothing changed)
        when the run is no longer DELAYED. The caller holds the run lock."""
        r = replacement
        params = {
            "id": run_id, "when": when, "replace": r is not None,
            "payload": None if r is None or r.payload is None else Jsonb(r.payload),
            "payload_type": None if r is None else r.payload_type,
            "metadata": None if r is None or r.metadata is None else Jsonb(r.metadata),
            "tags": None if r is None or not r.tags else list(r.tags),
            "max_attempts": None if r is None else r.max_attempts,
            "max_duration_s": None if r is None else r.max_duration_s,
            "machine": None if r is None else r.machine,
        }
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(_DEBOUNCE_SQL, params)
            row = await cur.fetchone()
        return run_row(row) if row else None

    async def release_expired_idempotency_keys(self, env_id: str, keys: Sequence[tuple[str, str, str | None]],
                                               now: datetime) -> None:
        """Free (task, key) pairs whose runs' idempotency TTL has passed, so a new run may take them;
        each with the batch its trigger is an item of (None: none), whose own run holding the key
        keeps it: that item was made already, and is sent again (a stream retried after its first
        attempt died before noting its items; an index makes one run, whatever its key's TTL)."""
        async with self.pool.connection() as conn:
            await conn.execute(
                """UPDATE task_run r SET idempotency_key = NULL, updated_at = clock_timestamp()
                   FROM (SELECT unnest(%s::text[]) AS task, unnest(%s::text[]) AS key,
                                unnest(%s::text[]) AS batch) k
                   WHERE r.environment_id = %s AND r.task_identifier = k.task AND r.idempotency_key = k.key
                     AND r.idempotency_key_expires_at <= %s
                     AND (k.batch IS NULL OR r.batch_id IS DISTINCT FROM k.batch)""",
                ([t for t, _, _ in keys], [k for _, k, _ in keys], [b for _, _, b in keys], env_id, now))

    async def reset_idempotency_key(self, env_id: str, task_id: str, key: str) -> int:
        """Free the task's idempotency key in the environment whatever its TTL (the SDK's
        ``idempotencyKeys.reset``): the next trigger with it makes a new run. How many runs held it."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                "UPDATE task_run SET idempotency_key = NULL, idempotency_key_expires_at = NULL, "
                "updated_at = clock_timestamp() "
                "WHERE environment_id = %s AND task_identifier = %s AND idempotency_key = %s", (env_id, task_id, key))
            return cur.rowcount

    async def runs_by_idempotency_key(self, env_id: str, keys: Sequence[tuple[str, str]],
                                      held_at: datetime | None = None) -> dict[tuple[str, str], RunRow]:
        """The runs holding these (task, key) pairs; with ``held_at``, only keys not expired then."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT r.* FROM task_run r
                   JOIN (SELECT unnest(%s::text[]) AS task, unnest(%s::text[]) AS key) k
                     ON r.task_identifier = k.task AND r.idempotency_key = k.key
                   WHERE r.environment_id = %s
                     AND (%s::timestamptz IS NULL OR r.idempotency_key_expires_at IS NULL
                          OR r.idempotency_key_expires_at > %s)""",
                ([t for t, _ in keys], [k for _, k in keys], env_id, held_at, held_at))
            return {(r["task_identifier"], r["idempotency_key"]): run_row(r) for r in await cur.fetchall()}

    async def transition_many(self, transitions: Sequence[Transition]) -> list[TransitionResult]:
        async with self.pool.connection() as conn:
            cur = conn.cursor()  # tuples, read by position: no dict of 60 columns per run
            await cur.execute(_TRANSITION_SQL, self._transition_params(transitions))
            rows = await cur.fetchall()
            with committed():
                return await self._transition_results(conn, rows)

    async def dequeue_and_start(self, runs: Sequence[DequeueStart], pending_description: str, start_description: str,
                                ) -> list[tuple[TransitionResult, TransitionResult, list[dict[str, Any]] | None]]:
        """Dequeue and start each run in one statement (:data:`_DEQUEUE_START_SQL`): per run, the
        PENDING_EXECUTING result (its run as it was dequeued, before the start), the EXECUTING
        one, and for a run restored or retried its journal (entries as JSON objects with their
        waitpoint's state: ``waitpoints.journal_entry`` reads them). A run that moved on (or
        lost its next snapshot to a concurrent transition) has neither applied."""
        params = {"rows": Jsonb([{"ord": i, "run_id": r.run_id, "pending_id": r.pending_snapshot_id,
                                  "executing_id": r.executing_snapshot_id, "worker_id": r.worker_id}
                                 for i, r in enumerate(runs)]),
                  "pending_description": pending_description, "start_description": start_description}
        async with self.pool.connection() as conn:
            cur = conn.cursor()  # tuples, read by position: no dict of 80 columns per run
            await cur.execute(_DEQUEUE_START_SQL, params)
            with committed():  # (autocommit) reading the rows back fails after the writes
                rows = await cur.fetchall()
            try:
                latest = await self._winners(conn, rows)
            except Exception:  # committed: a run that lost its race is dropped whatever won it
                log.warning("dequeue: could not read the snapshots that won %d races", len(rows), exc_info=True)
                latest = {}
        out: list[tuple[TransitionResult, TransitionResult, list[dict[str, Any]] | None]] = []
        for row in rows:
            run_id = row[0]
            pending_snapshot = from_slice(Snapshot, row, _DEQUEUE_HEAD)
            executing_snapshot = from_slice(Snapshot, row, _DEQUEUE_HEAD + _SNAPSHOT_COLUMNS)
            run = from_slice(RunRow, row, _DEQUEUE_HEAD + 2 * _SNAPSHOT_COLUMNS)
            if pending_snapshot is None or executing_snapshot is None or run is None:
                latest_id, latest_status = latest.get(run_id, (row[1], row[2]))
                missed = TransitionResult(run_id, False, latest_id, latest_status)
                out.append((missed, missed, None))
                continue
            # the run as the dequeue left it: the start's changes (status, attempt, first start) undone
            before = run.attempt_number - (executing_snapshot.attempt_number - pending_snapshot.attempt_number)
            dequeued = evolve(run, status="DEQUEUED", attempt_number=before,
                              started_at=run.started_at if before else None)
            out.append((TransitionResult(run_id, True, pending_snapshot.id, pending_snapshot.engine_status,
                                         pending_snapshot, dequeued),
                        TransitionResult(run_id, True, executing_snapshot.id, executing_snapshot.engine_status,
                                         executing_snapshot, run), row[4]))
        return out

    @staticmethod
    def _transition_params(transitions: Sequence[Transition]) -> dict[str, Any]:
        rows = [
            {"ord": i, "run_id": x.run_id, "new_id": x.new_snapshot_id, "engine_status": x.engine_status,
             "run_status": x.run_status, "froms": ",".join(x.from_statuses), "expected": x.expected_snapshot_id,
             "description": x.description, "attempt_delta": x.attempt_delta, "set_started": x.set_started,
             "set_finished": x.set_finished, "reopen": x.reopen, "output": x.output, "output_type": x.output_type,
             "error": x.error, "worker_id": x.worker_id, "checkpoint_id": x.checkpoint_id,
             "completed": list(x.completed_waitpoint_ids) or None, "resume": x.resume_checkpoint}
            for i, x in enumerate(transitions)
        ]
        return {"rows": Jsonb(rows)}

    @staticmethod
    async def _winners(conn: AsyncConnection[Any], rows: Sequence[Sequence[Any]]) -> dict[str, tuple[str, str]]:
        """run id -> (id, status) of the snapshot that won, for each row whose transition lost the
        race for its run's next snapshot (``t_conflict``, the head's fourth column): one query,
        only when there are any."""
        lost = [row[0] for row in rows if row[3]]
        if not lost:
            return {}
        cur = await conn.execute(_LATEST_OF_RUNS, (lost,))
        return {r[0]: (r[1], r[2]) for r in await cur.fetchall()}

    @staticmethod
    async def _transition_results(conn: AsyncConnection[Any], rows: Sequence[Sequence[Any]]) -> list[TransitionResult]:
        """The statement's rows as results; a transition that lost the race for its run's next
        snapshot reports the snapshot that won (one more query, only then)."""
        latest = await RunRepository._winners(conn, rows)
        out = []
        orphans = []
        for row in rows:
            run_id, latest_id, latest_status, conflict = row[:4]
            snapshot = from_slice(Snapshot, row, _TRANSITION_HEAD)
            run = from_slice(RunRow, row, _TRANSITION_HEAD + _SNAPSHOT_COLUMNS)
            if snapshot is not None and run is not None:
                out.append(TransitionResult(run_id, True, snapshot.id, snapshot.engine_status, snapshot, run))
                continue
            if snapshot is not None:
                # The run was deleted (retention) while this statement appended to it: its update
                # found no row. The snapshot, written after the delete's trigger, is taken back
                # and the run answered as gone.
                log.warning("run %s: snapshot %s appended but no run row updated (deleted meanwhile?): "
                            "taken back, answered as gone", run_id, snapshot.id)
                orphans.append(snapshot.id)
                latest_id = latest_status = None
            elif conflict:
                latest_id, latest_status = latest.get(run_id, (latest_id, latest_status))
            out.append(TransitionResult(run_id, False, latest_id, latest_status))
        if orphans:
            await conn.execute(_DROP_ORPHANS, (orphans,))
        return out

    async def get_run(self, run_id: str, env_id: str | None = None, *, light: bool = False) -> RunRow | None:
        """The run (of the environment, when one is given); ``light``: without payload, output,
        metadata and error (``None``)."""
        columns = _LIGHT_RUN if light else "*"
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            if env_id is None:
                await cur.execute(f"SELECT {columns} FROM task_run WHERE id = %s", (run_id,))
            else:
                await cur.execute(
                    f"SELECT {columns} FROM task_run WHERE id = %s AND environment_id = %s", (run_id, env_id)
                )
            row = await cur.fetchone()
        return run_row(row) if row else None

    async def runs_with_latest(self, run_ids: Sequence[str]) -> dict[str, tuple[RunRow, Snapshot]]:
        """Runs among ``run_ids`` with their latest valid snapshots, by id, in one query."""
        async with self.pool.connection() as conn:
            cur = conn.cursor()  # tuples, read by position
            await cur.execute(_RUNS_WITH_LATEST_SQL, (list(run_ids),))
            out: dict[str, tuple[RunRow, Snapshot]] = {}
            for row in await cur.fetchall():
                snapshot = from_slice(Snapshot, row, 0)
                run = from_slice(RunRow, row, _SNAPSHOT_COLUMNS)
                if snapshot is not None and run is not None:
                    out[run.id] = (run, snapshot)
            return out

    async def latest_snapshot(self, run_id: str) -> Snapshot | None:
        async with self.pool.connection() as conn:
            return await self._latest_snapshot(conn, run_id)

    @staticmethod
    async def _latest_snapshot(conn: AsyncConnection[Any], run_id: str) -> Snapshot | None:
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(
            """SELECT * FROM task_run_execution_snapshot
               WHERE run_id = %s AND is_valid ORDER BY seq DESC LIMIT 1""",
            (run_id,),
        )
        row = await cur.fetchone()
        return snapshot_row(row) if row else None

    async def snapshots_from(self, run_id: str, snapshot_id: str, limit: int) -> list[Snapshot]:
        """The run's valid snapshots from ``snapshot_id`` on, oldest first, ``limit`` at most (none
        when it is not one of the run's)."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT * FROM task_run_execution_snapshot
                   WHERE run_id = %(run)s AND is_valid
                     AND seq >= (SELECT seq FROM task_run_execution_snapshot WHERE id = %(id)s AND run_id = %(run)s)
                   ORDER BY seq LIMIT %(n)s""", {"run": run_id, "id": snapshot_id, "n": limit})
            return [snapshot_row(r) for r in await cur.fetchall()]

    async def snapshots(self, run_id: str) -> list[Snapshot]:
        """Every snapshot of a run, oldest first (the audit log)."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                "SELECT * FROM task_run_execution_snapshot WHERE run_id = %s ORDER BY seq", (run_id,)
            )
            return [snapshot_row(r) for r in await cur.fetchall()]

    @staticmethod
    def _run_filter(env_id: str, statuses: Sequence[str], tasks: Sequence[str], tags: Sequence[str],
                    queues: Sequence[str], batches: Sequence[str], after: tuple[datetime, str] | None,
                    created_from: datetime | None, created_to: datetime | None,
                    updated_after: datetime | None, ids: Sequence[str] = ()) -> tuple[str, dict[str, Any]]:
        """The WHERE clause and parameters of a run listing (see :meth:`list_runs`)."""
        where = ["environment_id = %(env)s"]
        params: dict[str, Any] = {"env": env_id, "from": created_from, "to": created_to}
        if created_from is not None:
            where.append("created_at >= %(from)s")
        if created_to is not None:
            where.append("created_at < %(to)s")
        if updated_after is not None:
            where.append("updated_at > %(upd)s")
            params["upd"] = updated_after
        for column, values, name in (("status", statuses, "st"), ("task_identifier", tasks, "tk"),
                                     ("queue", queues, "qu"), ("batch_id", batches, "ba"), ("id", ids, "ids")):
            if values:
                where.append(f"{column} = ANY(%({name})s)")
                params[name] = list(values)
        if tags:
            # the environment's own entries of the partial GIN index task_run_env_tags (its expression
            # and predicate, word for word): never another tenant's runs of the same tag. The plain
            # overlap first: when the planner walks the environment's runs instead (a common tag,
            # newest first), it is the cheap test (quals run cheapest first), env_tags only on a hit
            where.append("tags && %(tags)s::text[] AND env_tags(environment_id, tags) && env_tags(%(env)s, "
                         "%(tags)s::text[]) AND tags <> '{}'")
            params["tags"] = list(tags)
        if after is not None:
            where.append("(created_at, id) < (%(after_ts)s, %(after_id)s)")
            params["after_ts"], params["after_id"] = after
        return " AND ".join(where), params

    async def list_runs(self, env_id: str, *, statuses: Sequence[str] = (), tasks: Sequence[str] = (),
                        tags: Sequence[str] = (), queues: Sequence[str] = (), batches: Sequence[str] = (),
                        limit: int = 25, after: tuple[datetime, str] | None = None,
                        created_from: datetime | None = None, created_to: datetime | None = None,
                        updated_after: datetime | None = None, light: bool = False,
                        ids: Sequence[str] = (), timeout_s: float | None = None) -> list[RunRow]:
        """Newest first; ``after`` is the (created_at, id) of the last run of the previous page;
        ``created_from`` ≤ created_at < ``created_to``; ``updated_after`` < updated_at; only
        those of ``ids`` when given. ``light``: without payload, output, metadata and error
        (``None``), for callers that need none of them: a run's may be megabytes. ``timeout_s``:
        each statement's bound (:func:`bounded_read`; None: none)."""
        where, params = self._run_filter(env_id, statuses, tasks, tags, queues, batches, after, created_from,
                                         created_to, updated_after, ids)
        params["limit"] = limit
        async with bounded_read(self.pool, timeout_s) as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(f"SELECT {_LIGHT_RUN if light else '*'} FROM task_run WHERE {where} "
                              "ORDER BY created_at DESC, id DESC LIMIT %(limit)s", params)
            return [run_row(r) for r in await cur.fetchall()]

    async def shape_runs(self, env_id: str, *, tags: Sequence[str] = (), tasks: Sequence[str] = (),
                         batches: Sequence[str] = (), ids: Sequence[str] = (), limit: int,
                         created_from: datetime | None = None, updated_after: datetime | None = None,
                         timeout_s: float | None = None) -> ShapeRead:
        """The runs of a realtime shape as :meth:`list_runs` reads them light, with the id of the
        transaction that wrote each one's row (``xmin``, 32 bits) and the oldest transaction still
        running when they were read (the snapshot's xmin, 64 bits): a row written by a transaction
        older than that was visible to this read."""
        if tags and updated_after is None and not (batches or ids):
            walked = await self._shape_walk(env_id, tags, tasks, created_from, limit, timeout_s)
            if walked is not None:
                return walked
        where, params = self._run_filter(env_id, (), tasks, tags, (), batches, None, created_from, None,
                                         updated_after, ids)
        params["limit"] = limit
        async with bounded_read(self.pool, timeout_s) as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(f"SELECT {_LIGHT_RUN}, xmin::text::bigint AS row_xmin, "
                              "(SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint) AS snapshot_xmin "
                              f"FROM task_run WHERE {where} ORDER BY created_at DESC, id DESC LIMIT %(limit)s", params)
            rows = await cur.fetchall()
        return ShapeRead([run_row(r) for r in rows], {r["id"]: int(r["row_xmin"]) for r in rows},
                         int(rows[0]["snapshot_xmin"]) if rows else None)

    async def _shape_walk(self, env_id: str, tags: Sequence[str], tasks: Sequence[str],
                          created_from: datetime | None, limit: int, timeout_s: float | None) -> ShapeRead | None:
        """A tag shape's first read, when its runs are common among the environment's newest: the
        newest :data:`SHAPE_WALK_ROWS` of the environment's runs walked in order, those with a tag
        kept. The answer when ``limit`` of them have one or the walk saw every run of the window;
        None otherwise (a rare tag: its own index finds its few runs). The tag's index alone would
        fetch and sort every run of a common tag: a million of them, over a second a read."""
        params: dict[str, Any] = {"env": env_id, "from": created_from, "tags": list(tags), "tasks": list(tasks),
                                  "walk": SHAPE_WALK_ROWS, "limit": limit}
        async with bounded_read(self.pool, timeout_s) as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(_SHAPE_WALK, params)
            rows = await cur.fetchall()
        hits = [r for r in rows if r["id"] is not None]
        if len(hits) < limit and rows[0]["walked"] >= SHAPE_WALK_ROWS:
            return None
        return ShapeRead([run_row({k: v for k, v in r.items() if k not in _WALK_EXTRA}) for r in hits],
                         {r["id"]: int(r["row_xmin"]) for r in hits}, int(rows[0]["walk_snapshot_xmin"]))

    async def run_packets(self, env_id: str, run_ids: Sequence[str], *, item_bytes: int, budget_bytes: int,
                          answer_bytes: int, skip: Collection[str] = (),
                          timeout_s: float | None = None) -> tuple[dict[str, RunPackets], int]:
        """The payload, output, metadata and error of the environment's first runs among
        ``run_ids`` (in that order) that one realtime answer of ``answer_bytes`` holds, by id, and
        how many of ``run_ids`` that is (one at least; a run that is not there counts, without
        packets). A payload or output inline when it is under ``item_bytes`` and the inline ones so
        far stay within ``budget_bytes``, else flagged as stored (sizes measured until the budget,
        or four times it of measuring, is spent); metadata whole (bounded by its own limit); the
        error's message and stack cut to :data:`SHAPE_ERROR_CHARS`. Those of ``skip`` (``payload``,
        ``output``, ``metadata``, ``error``) are neither read nor counted."""
        if not run_ids:
            return {}, 0
        wanted = {field: field not in skip for field in ("payload", "output", "metadata", "error")}
        async with bounded_read(self.pool, timeout_s) as conn:
            cur = await conn.execute(_RUN_PACKETS, {"ids": list(run_ids), "env": env_id, "item": item_bytes,
                                                    "budget": budget_bytes, "work": 4 * budget_bytes,
                                                    "answer": answer_bytes, "chars": SHAPE_ERROR_CHARS, **wanted})
            rows = await cur.fetchall()
            return {r[0]: RunPackets(payload=r[1], payload_stored=r[1] is None and r[2], output=r[3],
                                     output_stored=r[3] is None and r[4], metadata=r[5], error=r[6])
                    for r in rows if r[0] is not None}, len(rows)

    async def packet_text(self, env_id: str, run_id: str, field: str) -> str | None:
        """The run's payload or output (``field``) as JSON text; None when it has none (or no such
        run in the environment)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(_PACKET_TEXT[field], (run_id, env_id))
            row = await cur.fetchone()
            return row[0] if row else None

    async def run_sizes(self, env_id: str, run_ids: Sequence[str], max_bytes: int) -> dict[str, int | None]:
        """What the environment's runs among ``run_ids`` take in payload, output, metadata and
        error (as JSON text), measured in order and no further than the first run whose sizes add
        up past ``max_bytes`` (those after it are left out); a run that is not there: None."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(_SIZES_WALK, {"ids": list(run_ids), "env": env_id, "max_bytes": max_bytes})
            return {r[0]: None if r[1] is None else int(r[1]) for r in await cur.fetchall()}

    async def runs_by_ids(self, env_id: str, run_ids: Sequence[str]) -> dict[str, RunRow]:
        """The environment's runs among ``run_ids``, by id, in one query."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute("SELECT * FROM task_run WHERE id = ANY(%s) AND environment_id = %s",
                              (list(run_ids), env_id))
            return {r["id"]: run_row(r) for r in await cur.fetchall()}

    async def page_runs(self, env_id: str, *, limit: int, max_bytes: int, statuses: Sequence[str] = (),
                        tasks: Sequence[str] = (), tags: Sequence[str] = (), queues: Sequence[str] = (),
                        batches: Sequence[str] = (), after: tuple[datetime, str] | None = None,
                        created_from: datetime | None = None, created_to: datetime | None = None,
                        updated_after: datetime | None = None, ids: Sequence[str] = (),
                        timeout_s: float | None = None) -> tuple[list[RunRow], bool]:
        """Like :meth:`list_runs`, whole runs, but fewer than ``limit`` when their payloads,
        outputs and metadata pass ``max_bytes`` (as JSON text; never fewer than one): one tenant's
        page of hundred 3 MiB payloads must not take the memory every tenant's requests share.
        Returns the runs and whether more match after the last of them."""
        where, params = self._run_filter(env_id, statuses, tasks, tags, queues, batches, after, created_from,
                                         created_to, updated_after, ids)
        params["limit"], params["max_bytes"] = limit + 1, max_bytes
        async with bounded_read(self.pool, timeout_s) as conn:
            cur = await conn.execute(page_walk("task_run", where, _RUN_BYTES), params)
            kept, more = walked_page(await cur.fetchall(), limit, max_bytes)
            whole = conn.cursor(row_factory=dict_row)
            await whole.execute("SELECT * FROM task_run WHERE id = ANY(%s) ORDER BY created_at DESC, id DESC", (kept,))
            runs = [run_row(r) for r in await whole.fetchall()]
        return runs, more

    async def list_batches(self, env_id: str, limit: int = 50, *, timeout_s: float | None = None) -> list[BatchView]:
        """The environment's batches, newest first, with how many of their runs have finished."""
        async with bounded_read(self.pool, timeout_s) as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT batch_id AS id, count(*) AS runs, min(created_at) AS created_at,
                          count(*) FILTER (WHERE finished_at IS NOT NULL) AS finished,
                          count(*) FILTER (WHERE status = 'COMPLETED') AS completed
                   FROM task_run WHERE environment_id = %s AND batch_id IS NOT NULL
                   GROUP BY batch_id ORDER BY min(created_at) DESC, batch_id DESC LIMIT %s""",
                (env_id, limit))
            return [BatchView(**r) for r in await cur.fetchall()]

    async def child_runs(self, run_id: str) -> list[str]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                "SELECT id FROM task_run WHERE parent_run_id = %s ORDER BY created_at LIMIT 100", (run_id,))
            return [r[0] for r in await cur.fetchall()]

    async def waiting_children(self, run_ids: Sequence[str]) -> list[tuple[str, bool]]:
        """The children whose completion the runs wait for that a cancel of the runs goes to (not
        finished) or through (cancelled: a cancel that stopped part way may have left theirs), in
        one query: (id, whether it has finished)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT id, finished_at IS NOT NULL FROM task_run
                   WHERE parent_run_id = ANY(%s) AND resume_parent_on_completion
                     AND (finished_at IS NULL OR status = 'CANCELED')
                   ORDER BY created_at, id""", (list(run_ids),))
            return [(r[0], r[1]) for r in await cur.fetchall()]

    async def begin_cancel_cascade(self, run_id: str) -> None:
        """Note that a cancel goes down the runs ``run_id`` waits on (migration 0052): the
        reconciler arms its job again until :meth:`end_cancel_cascade` (a run gone: nothing)."""
        async with self.pool.connection() as conn:
            await conn.execute(
                """INSERT INTO cancel_cascade (run_id) SELECT id FROM task_run WHERE id = %s
                   ON CONFLICT DO NOTHING""", (run_id,))

    async def end_cancel_cascade(self, run_id: str) -> None:
        """The cancel of ``run_id`` reached the end of the runs below it."""
        async with self.pool.connection() as conn:
            await conn.execute("DELETE FROM cancel_cascade WHERE run_id = %s", (run_id,))

    async def version_locks(self, run_ids: Sequence[str]) -> dict[str, str]:
        """run id → the deployment it is locked to, for the runs of ``run_ids`` triggered with
        lockToVersion (the others are any deployment's that has their task)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT id, locked_to_deployment_id FROM task_run
                   WHERE id = ANY(%s) AND locked_to_version IS NOT NULL""", (list(run_ids),))
            return {r[0]: r[1] for r in await cur.fetchall()}

    async def pending_version_runs(self, env_id: str, worker_group_id: str, tasks: Sequence[str],
                                   limit: int | None = None) -> list[str]:
        """The environment's PENDING_VERSION runs of these tasks in the group, oldest first (at
        most ``limit``)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT id FROM task_run
                   WHERE environment_id = %s AND worker_group_id = %s
                     AND status = 'PENDING_VERSION' AND task_identifier = ANY(%s)
                   ORDER BY created_at LIMIT %s""",
                (env_id, worker_group_id, list(tasks), limit),
            )
            return [r[0] for r in await cur.fetchall()]

    async def assign_deployment(self, run_ids: Sequence[str], deployment_id: str, queue_of: dict[str, str]) -> None:
        """Lock PENDING_VERSION (or due DELAYED) runs to the deployment that can run them; runs put in
        their task's default queue move to the queue the deployment declares for the task. A run
        triggered with lockToVersion keeps its deployment and queue (a process of the version
        before, which ignores the option, may have made it PENDING_VERSION)."""
        async with self.pool.connection() as conn:
            await conn.execute(
                """UPDATE task_run r SET
                       locked_to_deployment_id = CASE WHEN r.locked_to_version IS NOT NULL
                                                       AND r.locked_to_deployment_id IS NOT NULL
                                                      THEN r.locked_to_deployment_id ELSE %(dep)s END,
                       queue = CASE WHEN r.queue = 'task/' || r.task_identifier
                                     AND (r.locked_to_version IS NULL OR r.locked_to_deployment_id IS NULL)
                                    THEN coalesce((%(queues)s::jsonb) ->> r.task_identifier, r.queue)
                                    ELSE r.queue END
                   WHERE r.id = ANY(%(ids)s) AND r.status IN ('PENDING_VERSION', 'DELAYED')""",
                {"dep": deployment_id, "queues": Jsonb(queue_of), "ids": list(run_ids)},
            )

    async def slot_holders(self, run_ids: Sequence[str]) -> dict[str, tuple[str, str]]:
        """run id → (latest execution status, latest snapshot id), for runs that may hold a queue slot."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT r.id, s.engine_status, s.id FROM task_run r
                   CROSS JOIN LATERAL (SELECT id, engine_status FROM task_run_execution_snapshot
                                       WHERE run_id = r.id AND is_valid ORDER BY seq DESC LIMIT 1) s
                   WHERE r.id = ANY(%s)""", (list(run_ids),))
            return {r[0]: (r[1], r[2]) for r in await cur.fetchall()}

    async def set_metadata(self, run_id: str, metadata: Any) -> None:
        """Replace the run's metadata; the first replacement keeps the metadata the run was
        triggered with as its seed (``seed_metadata``, migration 0050: what a replay starts with)."""
        async with self.pool.connection() as conn:
            await conn.execute(
                # the right-hand sides read the row as it was: seed_metadata takes the metadata replaced
                "UPDATE task_run SET metadata = %s, "
                "seed_metadata = coalesce(seed_metadata, jsonb_build_array(metadata)), "
                "updated_at = clock_timestamp() WHERE id = %s", (Jsonb(metadata), run_id))

    async def change_metadata(self, env_id: str, run_ids: Collection[str], change: Callable[[str, Any], Any], *,
                              request: MetadataRequest | None = None) -> dict[str, tuple[Any, bool]]:
        """Change the metadata of the environment's runs among ``run_ids`` in one transaction:
        each row is locked (``FOR UPDATE``, in id order: two requests that touch the same runs
        wait for each other, never in a deadlock), ``change(run id, metadata)`` gives its new
        metadata (``None``: unchanged), and the changed ones are written in one statement, the
        first write keeping the trigger's metadata as the seed (as :meth:`set_metadata`). What
        ``change`` raises rolls everything back. → run id → (metadata after, written), for the
        runs found.

        With ``request`` (a request with an idempotency key, on the metadata of its run): read on
        that run's locked row (``metadata_requests``, migration 0054), a request it names already
        changes nothing (→ the metadata as it is, nothing written; ``ConflictError`` if its key
        named another body), and one it does not is remembered there (the last
        :data:`METADATA_REQUESTS_KEPT`) in this transaction, written or not."""
        own = request.run_id if request is not None else None
        async with self.pool.connection() as conn, conn.transaction():
            cur = await conn.execute("SELECT id, metadata, CASE WHEN id = %s THEN metadata_requests END "
                                     "FROM task_run WHERE id = ANY(%s) AND environment_id = %s "
                                     "ORDER BY id FOR UPDATE", (own, sorted(run_ids), env_id))
            rows = await cur.fetchall()
            remembered: list[str] | None = None
            for run_id, _, seen in rows:
                if request is not None and run_id == own:
                    if request.seen_in(seen or ()):  # sent again: its first try applied it
                        return {r[0]: (r[1], False) for r in rows}
                    remembered = [*(seen or ()), request.entry][-METADATA_REQUESTS_KEPT:]
            after: dict[str, tuple[Any, bool]] = {}
            for run_id, metadata, _ in rows:
                new = change(run_id, metadata)
                after[run_id] = (metadata, False) if new is None else (new, True)
            written = {run_id: m for run_id, (m, w) in after.items() if w}
            if written:
                # the right-hand sides read the row as it was: seed_metadata takes the metadata replaced
                await conn.execute(
                    "UPDATE task_run SET metadata = v.metadata, "
                    "seed_metadata = coalesce(task_run.seed_metadata, jsonb_build_array(task_run.metadata)), "
                    "metadata_requests = CASE WHEN task_run.id = %s THEN %s::text[] "
                    "ELSE task_run.metadata_requests END, "
                    "updated_at = clock_timestamp() FROM jsonb_each(%s) AS v(id, metadata) WHERE task_run.id = v.id",
                    (own if remembered is not None else None, remembered, Jsonb(written)))
            if remembered is not None and own not in written:
                # nothing of its own changed (its parent's, its root's, or nothing at all): remembered
                # all the same, without a change the run's readers would see (updated_at)
                await conn.execute("UPDATE task_run SET metadata_requests = %s WHERE id = %s", (remembered, own))
        return after

    async def seed_metadata(self, run_ids: Sequence[str]) -> dict[str, Any]:
        """The metadata each of ``run_ids`` was triggered with, for those whose metadata was replaced
        since (the others' own metadata is still their seed), by id."""
        async with self.pool.connection() as conn:
            cur = await conn.execute("SELECT id, seed_metadata -> 0 FROM task_run "
                                     "WHERE id = ANY(%s) AND seed_metadata IS NOT NULL", (list(run_ids),))
            return {r[0]: r[1] for r in await cur.fetchall()}

    async def add_tags(self, run_id: str, tags: Sequence[str], limit: int) -> list[str] | None:
        """Add tags (kept once, in order); ``None`` if the run would have more than ``limit``.
        The merge reads the row it updates (its own columns, in SET and WHERE): an add held up
        behind another's row lock merges into the tags that one left, which PostgreSQL reads again
        after the wait (a subquery of the row in FROM is not read again: the other's tags were lost)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """UPDATE task_run SET tags = array(SELECT t FROM unnest(tags || %(tags)s::text[])
                                                    WITH ORDINALITY u(t, n) GROUP BY t ORDER BY min(n)),
                                       updated_at = clock_timestamp()
                   WHERE id = %(run)s
                     AND (SELECT count(DISTINCT t) FROM unnest(tags || %(tags)s::text[]) u(t)) <= %(limit)s
                   RETURNING tags""", {"tags": list(tags), "run": run_id, "limit": limit})
            row = await cur.fetchone()
        return list(row[0]) if row else None

    async def mark_waited_on(self, run_id: str) -> None:
        """Something waits on the run: its finish completes its RUN waitpoints."""
        async with self.pool.connection() as conn:
            await conn.execute("UPDATE task_run SET resume_parent_on_completion = true "
                               "WHERE id = %s AND NOT resume_parent_on_completion", (run_id,))

    async def set_machine(self, run_id: str, machine: str) -> None:
        """The machine the run's next attempts run on."""
        async with self.pool.connection() as conn:
            await conn.execute("UPDATE task_run SET machine = %s, updated_at = clock_timestamp() WHERE id = %s",
                               (machine, run_id))

    async def set_delay_until(self, run_id: str, when: datetime) -> None:
        async with self.pool.connection() as conn:
            await conn.execute("UPDATE task_run SET delay_until = %s, queue_timestamp = %s, "
                               "updated_at = clock_timestamp() WHERE id = %s", (when, when, run_id))
