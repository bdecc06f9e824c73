"""Runs as a shape stream, the long-poll protocol of ElectricSQL that Trigger.dev's SDK reads
(``runs.subscribeToRun``, ``subscribeToRunsWithTag``, ``subscribeToBatch``, its realtime hooks):
``GET /realtime/v1/runs/{runId}?offset=…`` (without an ``offset`` that path serves run-engine's own
Server-Sent Events, :mod:`run_engine.api.stream`), ``/realtime/v1/runs?tags=…``,
``/realtime/v1/batches/{batchId}`` (:mod:`run_engine.api.realtime_shapes`).

The first request (``offset=-1``) answers with the runs as ``insert``s and ``up-to-date``; each
later one (``live=true``) waits until a run changes (any server process: RealtimeHub), then answers
with the changed runs, or after a while with ``up-to-date`` alone. The runs go in the order of their
last change (then id), and the offset says how far the client got: the newest change sent, in
microseconds, with a checksum of the runs changed shortly before it, so that a client that comes
back late gets every change at once and none is lost to a late commit.

An answer is bounded in bytes whatever the runs hold: the runs are read without their payload,
output, metadata and error, and those of the runs sent are read after, a payload or output inline
only while it is small (under :data:`PACKET_INLINE_BYTES`) and the answer's inline ones stay within
:data:`ANSWER_INLINE_BYTES`; any other goes as ``application/store``, a reference the SDK fetches
(``GET /api/v1/runs/{runId}/packets/{field}``, :mod:`run_engine.api.packets`), as Trigger.dev sends
a packet it keeps in object storage. Metadata and errors have no such reference: an answer ends
before the run that would take it past :data:`ANSWER_BYTES`, without ``up-to-date``, and the client
asks at once for the rest (the offset then names the last run sent), as ElectricSQL sends a large
shape in chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from run_engine.api.context import ApiContext, EnvAuth
from run_engine.api.http import ApiError
from run_engine.api.inputs import is_number
from run_engine.engine import RunPackets, RunRow, ShapeRead

LIVE_WAIT_S = 20.0
#: a run's updated_at is its transaction's start: one that began before a change already sent may
#: commit after it; runs changed this long before the newest change sent are checked again
GRACE_US = 2_000_000
#: run-engine's statuses as the raw TaskRun statuses the SDK maps back (its apiStatusFromRunStatus)
RAW_STATUS = {"QUEUED": "PENDING", "COMPLETED": "COMPLETED_SUCCESSFULLY", "FAILED": "COMPLETED_WITH_ERRORS",
              "WAITING": "WAITING_TO_RESUME"}
UP_TO_DATE = {"headers": {"control": "up-to-date"}}
MUST_REFETCH = {"headers": {"control": "must-refetch"}}
#: a payload or output this large (as JSON text) or larger is sent by reference: Trigger.dev's SDK
#: offloads its own packets from this size (OFFLOAD_IO_PACKET_LENGTH_LIMIT)
PACKET_INLINE_BYTES = 128 * 1024
#: the payloads and outputs inline in one answer, at most (the rest by reference)
ANSWER_INLINE_BYTES = 4 * 1024 * 1024
#: what one answer holds at most of inline payloads and outputs, metadata and errors (one run at
#: least): the rest of the runs go in the next answers, which the client asks for at once
ANSWER_BYTES = 8 * 1024 * 1024
#: what a payload or output sent by reference holds instead: the SDK asks for the run's packet by
#: run and field, and falls back to this path on a server without that route
STORE = "application/store"


def _naive(value: datetime | None) -> str | None:
    """A date as the raw shape has it: ISO without an offset, in UTC (the SDK appends the Z)."""
    return None if value is None else value.astimezone(UTC).replace(tzinfo=None).isoformat()


def packet_path(run_id: str, field: str) -> str:
    return f"{run_id}/{field}.json"


def _error(error: dict[str, Any] | None) -> dict[str, Any] | None:
    if not error:
        return None
    return {"type": "BUILT_IN_ERROR", "name": str(error.get("name") or error.get("type") or "Error"),
            "message": str(error.get("message") or ""), "stackTrace": str(error.get("stackTrace") or "")}


def raw_row(run: RunRow, packets: RunPackets | None) -> dict[str, Any]:
    """The run as the SDK's SubscribeRunRawShape reads it; its payload, output, metadata and error
    from ``packets`` (:meth:`RunEngine.run_packets`; ``None``: deleted meanwhile, sent without)."""
    p = packets or RunPackets(None, False, None, False, None, None)
    completed = run.status == "COMPLETED"
    duration_ms = 0
    if run.started_at and run.finished_at:
        duration_ms = int((run.finished_at - run.started_at).total_seconds() * 1000)
    return {
        "id": run.id, "friendlyId": run.id, "taskIdentifier": run.task_id,
        "status": RAW_STATUS.get(run.status, run.status),
        "createdAt": _naive(run.created_at), "updatedAt": _naive(run.updated_at),
        "startedAt": _naive(run.started_at), "delayUntil": _naive(run.delay_until),
        "queuedAt": _naive(run.queued_at), "completedAt": _naive(run.finished_at),
        "expiredAt": _naive(run.finished_at) if run.status == "EXPIRED" else None,
        "idempotencyKey": run.idempotency_key, "number": 0, "isTest": False, "usageDurationMs": duration_ms,
        "costInCents": 0, "baseCostInCents": 0, "ttl": None,
        "payload": packet_path(run.id, "payload") if p.payload_stored else p.payload,
        "payloadType": STORE if p.payload_stored else "application/json",
        "metadata": p.metadata, "metadataType": "application/json" if p.metadata is not None else None,
        "output": (packet_path(run.id, "output") if p.output_stored else p.output) if completed else None,
        "outputType": (STORE if p.output_stored else "application/json")
        if completed and (p.output is not None or p.output_stored) else None,
        "runTags": list(run.tags), "error": _error(p.error), "realtimeStreams": [],
    }


def _micros(value: datetime) -> int:
    return int(value.timestamp() * 1_000_000)


def _key(run: RunRow) -> str:
    return f'"public"."TaskRun"/"{run.id}"'


#: where a run stands in a shape's log: its last change (µs), then its id
Position = tuple[int, str]
#: the id part of a position past every run changed in that microsecond
ALL = "~"
_RUN_ID = re.compile(r"[a-z0-9]{1,64}")
MAX_OFFSET_US = 253_402_214_400_000_000  # 9999-12-31: a date Python can still hold (a greater offset: 400)
MAX_OFFSET_CHARS = 160


def _position(run: RunRow) -> Position:
    return _micros(run.updated_at), run.id


@dataclass(frozen=True)
class Cursor:
    """What a client was sent, as its offset carries it: every run up to ``at`` that was there when
    it was read; ``checksum``, the runs then in the window just before ``at`` (changed within GRACE:
    a late commit would land there); ``xmin``, the oldest transaction still running at that read
    (only a row written by it or a younger one can be a late commit; None: not known, any can);
    ``resend``, when late commits are being sent in parts, how far that got."""
    at: Position
    checksum: int
    xmin: int | None = None
    resend: Position | None = None

    def offset(self) -> str:
        """``<µs>_<checksum>`` (no xmin known, the client has all of that microsecond), else
        ``…_<id or ~>_<xmin>`` and, while late commits are resent, ``…_<µs>_<id>``."""
        head = f"{self.at[0]}_{self.checksum}"
        if self.xmin is None and self.resend is None and self.at[1] == ALL:
            return head
        out = f"{head}_{_suffix(self.at[1])}_{self.xmin if self.xmin is not None else ''}"
        return out if self.resend is None else f"{out}_{self.resend[0]}_{_suffix(self.resend[1])}"


#: a client that has nothing yet (``offset=-1``)
START = Cursor((0, ALL), 0)


def _suffix(run_id: str) -> str:
    return run_id if run_id == ALL else run_id.removeprefix("run_")


def _number(raw: str) -> int:
    if not is_number(raw) or len(raw) > 20 or int(raw) > MAX_OFFSET_US:
        raise _bad_offset()
    return int(raw)


def _run_id(raw: str) -> str:
    if raw == ALL:
        return ALL
    if not _RUN_ID.fullmatch(raw):
        raise _bad_offset()
    return "run_" + raw


class Refetch(Exception):
    """An offset of another version of this server (what it is made of, in a number of parts this
    one does not know: a rolling upgrade, a rollback): the client is told to start over."""


#: what an offset of any version of this server is made of
_ANY_VERSION = re.compile(r"[0-9]{1,20}(?:_[0-9a-z~]{0,64}){1,9}")


def parse_offset(offset: str) -> Cursor:
    """The cursor an offset this server answered with carries; 400 for anything else, but
    :class:`Refetch` for one another version of it could have answered with."""
    parts = offset.split("_") if len(offset) <= MAX_OFFSET_CHARS else []
    if len(parts) not in (2, 4, 6):
        if _ANY_VERSION.fullmatch(offset):
            raise Refetch(offset)
        raise _bad_offset()
    at_us, checksum = _number(parts[0]), _number(parts[1])
    if len(parts) == 2:  # as the first offsets this server answered with
        return Cursor((at_us, ALL), checksum)
    xmin = _number(parts[3]) if parts[3] else None
    resend = (_number(parts[4]), _run_id(parts[5])) if len(parts) == 6 else None
    if resend is not None and resend[1] == ALL:
        raise _bad_offset()
    return Cursor((at_us, _run_id(parts[2])), checksum, xmin, resend)


def _bad_offset() -> ApiError:
    return ApiError(400, "invalid_input", "offset: not an offset this server answered with")


def _window(ordered: list[RunRow], at: Position) -> list[RunRow]:
    """The runs up to ``at`` changed within GRACE before it."""
    return [r for r in ordered if at[0] - GRACE_US < _micros(r.updated_at) and _position(r) <= at]


def _checksum(runs: list[RunRow], xmins: dict[str, int]) -> int:
    """Of each run's version: its id, its change and the transaction that wrote it (two that
    began in the same microsecond write versions with the same change)."""
    return sum(zlib.crc32(f"{r.id}@{_micros(r.updated_at)}@{xmins.get(r.id, 0)}".encode())
               for r in runs) % 1_000_000_000_000


#: transaction ids are compared as PostgreSQL compares them, modulo 2^32 (a row's xmin is 32 bits);
#: a cursor whose xmin is this far behind the read's is too old for that: any row may be late
_XID_SPAN = 2**30


def _maybe_late(read: ShapeRead, cursor: Cursor) -> Callable[[RunRow], bool]:
    """Whether a run at or before the cursor may be one the client never had: its row written by
    a transaction that was still running when the cursor was read, or younger. A run changed again
    since (and so after the cursor, sent anyway) never is: the window changing for that alone
    resends nothing."""
    oldest = cursor.xmin
    if oldest is None or read.snapshot_xmin is None or read.snapshot_xmin - oldest > _XID_SPAN:
        return lambda _run: True
    low = oldest % 2**32

    def late(run: RunRow) -> bool:
        xmin = read.xmins.get(run.id)
        return xmin is None or (xmin - low) % 2**32 < 2**31  # written by `oldest` or after it

    return late


def unsent(read: ShapeRead, cursor: Cursor) -> tuple[list[RunRow], int]:
    """The runs a client with ``cursor`` has still to be sent, in the order they are sent (by
    position), and how many of the first ones are sent again. A run changed after the cursor is
    unsent; and when the runs changed within GRACE before it are not those it saw (a transaction
    that began earlier committed later), those of them that may be late commits are sent again (in
    parts if they must be: ``resend`` is how far that got)."""
    ordered = sorted(read.runs, key=_position)
    window = _window(ordered, cursor.at)
    if _checksum(window, read.xmins) != cursor.checksum:
        again = list(filter(_maybe_late(read, cursor), window))
    elif cursor.resend is not None:
        late = _maybe_late(read, cursor)
        again = [r for r in window if _position(r) > cursor.resend and late(r)]
    else:
        again = []
    return again + [r for r in ordered if _position(r) > cursor.at], len(again)


def advance(cursor: Cursor, read: ShapeRead, pending: list[RunRow], again: int, sent: int) -> Cursor:
    """The cursor of a client that had ``cursor`` once it got the first ``sent`` of ``pending``
    (:func:`unsent`, with ``again`` runs sent again first) of the shape's runs as ``read`` now."""
    at, xmin, resend = cursor.at, cursor.xmin, None
    if sent < again:  # late commits cut short: the rest of them next time
        resend = _position(pending[sent - 1])
    elif sent > again:  # every run up to the last one sent, as this read saw them
        last = pending[sent - 1]
        at, xmin = (_micros(last.updated_at), ALL if sent == len(pending) else last.id), read.snapshot_xmin
    return Cursor(at, _checksum(_window(sorted(read.runs, key=_position), at), read.xmins), xmin, resend)


def _answer(handle: str, cursor: Cursor, messages: list[dict[str, Any]], *, live: bool, complete: bool) -> Response:
    headers = {"electric-handle": handle, "electric-offset": cursor.offset(), "electric-schema": "{}",
               "Cache-Control": "no-store"}
    if live:
        headers["electric-cursor"] = str(cursor.at[0])
    if complete:  # the header too, as ElectricSQL: its client reads it to stop prefetching
        messages.append(UP_TO_DATE)
        headers["electric-up-to-date"] = ""
    return Response(orjson.dumps(messages), media_type="application/json", headers=headers)


#: the runs of a shape, light (without payload, output, metadata and error: they are read for the
#: runs sent only, within the answer's bytes), as one statement read them; with a date, only those
#: changed after it (what a live request needs)
Loader = Callable[[datetime | None], Awaitable[ShapeRead]]


#: what ``skipColumns`` cannot leave out (as Trigger.dev's realtime server)
RESERVED_COLUMNS = frozenset({"id", "taskIdentifier", "friendlyId", "status", "createdAt"})
_PACKET_COLUMNS = frozenset({"payload", "output", "metadata", "error"})


def skip_columns(request: Request) -> frozenset[str]:
    """The columns the client asked to be left out (``skipColumns=payload,output``, as the SDK's
    ``skipColumns`` option sends them), but those that identify a run."""
    raw = request.query_params.get("skipColumns", "")
    names = [n.strip() for n in raw.split(",") if n.strip()]
    if len(names) > 40 or any(len(n) > 64 for n in names):
        raise ApiError(400, "invalid_input", "skipColumns: at most 40 column names of at most 64 characters")
    return frozenset(names) - RESERVED_COLUMNS


async def _messages(ctx: ApiContext, env_id: str, runs: list[RunRow], since: int | None,
                    skip: frozenset[str]) -> list[dict[str, Any]]:
    """The first of ``runs`` that one answer holds (:data:`ANSWER_BYTES`, one run at least), as
    shape messages: inserts (``since`` None), else an insert for a run created after ``since`` and
    an update for any other; without the ``skip`` columns (and without reading the packets at all
    when every one of them is skipped)."""
    packets: dict[str, RunPackets] = {}
    if _PACKET_COLUMNS <= skip:
        taken = len(runs)
    else:
        packets, taken = await ctx.engine.run_packets(
            env_id, [r.id for r in runs], item_bytes=PACKET_INLINE_BYTES, budget_bytes=ANSWER_INLINE_BYTES,
            answer_bytes=ANSWER_BYTES, skip=skip & _PACKET_COLUMNS)
    out = []
    for r in runs[:taken]:
        value = raw_row(r, packets.get(r.id))
        if skip:
            value = {k: v for k, v in value.items() if k not in skip}
        out.append({"key": _key(r), "value": value, "headers": {
            "operation": "insert" if since is None or _micros(r.created_at) > since else "update"}})
    return out


async def shape(ctx: ApiContext, auth: EnvAuth, request: Request, handle: str, load: Loader, watch_key: str,
                *, min_interval_s: float = 0.0) -> Response:
    """Answer one request of the shape protocol for the runs ``load`` reads (in the caller's
    environment): every run at ``offset=-1``, those the offset has not had after it; with
    ``live=true``, waiting (≤ :data:`LIVE_WAIT_S`) until there is one. An answer holds what
    :data:`ANSWER_BYTES` allows: without ``up-to-date`` when there is more, which the client asks
    for next with the answer's offset. ``watch_key`` is what RealtimeHub wakes on."""
    offset = request.query_params.get("offset", "-1")
    live = request.query_params.get("live") == "true"
    skip = skip_columns(request)
    try:
        cursor = START if offset == "-1" else parse_offset(offset)
    except Refetch:  # ElectricSQL's answer to an offset it cannot serve: the client starts again at -1
        return Response(orjson.dumps([MUST_REFETCH]), status_code=409, media_type="application/json",
                        headers={"electric-handle": handle, "Cache-Control": "no-store"})
    # only the runs changed within GRACE before the offset or after it (all of them at first)
    changed_after = None if cursor is START else datetime.fromtimestamp((cursor.at[0] - GRACE_US) / 1_000_000, UTC)

    async def load_in_turn() -> ShapeRead:  # an environment's reads take at most its share of the pool
        async with ctx.costly_reads.turn(auth.env_id):
            return await load(changed_after)

    read = await load_in_turn()
    pending, again = unsent(read, cursor)
    if not pending and live:
        hub = ctx.realtime
        if hub is None:
            raise ApiError(503, "unavailable", "realtime is not running in this process")
        loop = asyncio.get_running_loop()
        with ctx.hold("streams", auth.bucket):
            async with hub.watch(watch_key) as changed:
                deadline = loop.time() + LIVE_WAIT_S
                while not pending:
                    remaining = deadline - loop.time()
                    if remaining <= 0 or await request.is_disconnected():
                        return _answer(handle, advance(cursor, read, [], 0, 0), [], live=True, complete=True)
                    changed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(changed.wait(), min(remaining, 5.0))
                    if min_interval_s:  # a busy environment wakes a multi-run shape often: read at most this often
                        await asyncio.sleep(min_interval_s)
                    read = await load_in_turn()
                    pending, again = unsent(read, cursor)
    # until the client is up to date, every run it is sent is new to it
    async with ctx.costly_reads.turn(auth.env_id):
        messages = await _messages(ctx, auth.env_id, pending, cursor.at[0] if live else None, skip)
    sent = len(messages)
    return _answer(handle, advance(cursor, read, pending, again, sent), messages, live=live,
                   complete=sent == len(pending))
