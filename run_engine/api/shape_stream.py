"""Runs as a shape stream, the long-poll protocol of ElectricSQL that Trigger.dev's SDK reads
(``runs.subscribeToRun``, ``subscribeToRunsWithTag``, ``subscribeToBatch``, its realtime hooks):
``GET /realtime/v1/runs/{runId}?offset=…`` (without an ``offset`` that path serves run-engine's own
Server-Sent Events, :mod:`run_engine.api.stream`), ``/realtime/v1/runs?tags=…``,
``/realtime/v1/batches/{batchId}`` (:mod:`run_engine.api.realtime_shapes`).

The first request (``offset=-1``) answers with every run as an ``insert`` and ``up-to-date``; each
later one (``live=true``) waits until a run changes (any server process: RealtimeHub), then answers
with the changed runs, or after a while with ``up-to-date`` alone. The offset is the newest
``updated_at`` sent, in microseconds, with a checksum of the runs changed shortly before it, so a
client that comes back late gets every change at once and none is lost to a late commit.

An answer is bounded in bytes whatever the runs hold: the runs are read without their payload,
output, metadata and error, and those of the runs sent are read after, a payload or output inline
only while it is small (under :data:`PACKET_INLINE_BYTES`) and the answer's inline ones stay within
:data:`ANSWER_INLINE_BYTES`; any other goes as ``application/store``, a reference the SDK fetches
(``GET /api/v1/runs/{runId}/packets/{field}``, :mod:`run_engine.api.packets`), as Trigger.dev sends
a packet it keeps in object storage.
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from run_engine.api.context import ApiContext, EnvAuth
from run_engine.api.http import ApiError
from run_engine.api.inputs import is_number
from run_engine.engine import RunPackets, RunRow

LIVE_WAIT_S = 20.0
#: a run's updated_at is its transaction's start: one that began before a change already sent may
#: commit after it; runs changed this long before the newest change sent are checked again
GRACE_US = 2_000_000
#: run-engine's statuses as the raw TaskRun statuses the SDK maps back (its apiStatusFromRunStatus)
RAW_STATUS = {"QUEUED": "PENDING", "COMPLETED": "COMPLETED_SUCCESSFULLY", "FAILED": "COMPLETED_WITH_ERRORS",
              "WAITING": "WAITING_TO_RESUME"}
UP_TO_DATE = {"headers": {"control": "up-to-date"}}
#: a payload or output this large (as JSON text) or larger is sent by reference: Trigger.dev's SDK
#: offloads its own packets from this size (OFFLOAD_IO_PACKET_LENGTH_LIMIT)
PACKET_INLINE_BYTES = 128 * 1024
#: the payloads and outputs inline in one answer, at most (the rest by reference)
ANSWER_INLINE_BYTES = 4 * 1024 * 1024
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


MAX_OFFSET_US = 253_402_214_400_000_000  # 9999-12-31: a date Python can still hold (a greater offset: 400)


def _since(offset: str) -> tuple[int, int]:
    """The newest change sent (µs) and the checksum of the runs changed within GRACE of it, as an
    offset this server answered with (``<µs>_<checksum>``) carries them; 400 for anything else."""
    head, _, tail = offset.partition("_")
    if not is_number(head) or not is_number(tail) or len(head) > 20 or len(tail) > 12 or int(head) > MAX_OFFSET_US:
        raise ApiError(400, "invalid_input", "offset: not an offset this server answered with")
    return int(head), int(tail)


def _window(runs: list[RunRow], newest: int) -> list[RunRow]:
    return [r for r in runs if newest - GRACE_US < _micros(r.updated_at) <= newest]


def _checksum(runs: list[RunRow]) -> int:
    return sum(zlib.crc32(f"{r.id}@{_micros(r.updated_at)}".encode()) for r in runs) % 1_000_000_000_000


def _answer(handle: str, runs: list[RunRow], messages: list[dict[str, Any]], *, live: bool,
            floor: int = 0) -> Response:
    newest = max([floor, *(_micros(r.updated_at) for r in runs)])
    offset = f"{newest}_{_checksum(_window(runs, newest))}"
    headers = {"electric-handle": handle, "electric-offset": offset, "electric-schema": "{}",
               "Cache-Control": "no-store"}
    if live:
        headers["electric-cursor"] = str(newest)
        headers["electric-up-to-date"] = ""
    return Response(orjson.dumps(messages), media_type="application/json", headers=headers)


#: the runs of a shape, light (without payload, output, metadata and error: they are read for the
#: runs sent only, within the answer's bytes); with a date, only those changed after it (what a live
#: request needs)
Loader = Callable[[datetime | None], Awaitable[list[RunRow]]]


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
    """``runs`` as shape messages: inserts (``since`` None), else an insert for a run created after
    ``since`` and an update for any other; without the ``skip`` columns (and without reading the
    packets at all when every one of them is skipped)."""
    packets = {} if _PACKET_COLUMNS <= skip else await ctx.engine.run_packets(
        env_id, [r.id for r in runs], item_bytes=PACKET_INLINE_BYTES, budget_bytes=ANSWER_INLINE_BYTES)
    out = []
    for r in runs:
        value = raw_row(r, packets.get(r.id))
        if skip:
            value = {k: v for k, v in value.items() if k not in skip}
        out.append({"key": _key(r), "value": value, "headers": {
            "operation": "insert" if since is None or _micros(r.created_at) > since else "update"}})
    return out


async def shape(ctx: ApiContext, auth: EnvAuth, request: Request, handle: str, load: Loader, watch_key: str,
                *, min_interval_s: float = 0.0) -> Response:
    """Answer one request of the shape protocol for the runs ``load`` reads (in the caller's
    environment): every run at ``offset=-1``; with ``live=true``, those changed since the offset,
    waiting (≤ :data:`LIVE_WAIT_S`) until one does. ``watch_key`` is what RealtimeHub wakes on."""
    offset = request.query_params.get("offset", "-1")
    live = request.query_params.get("live") == "true"
    skip = skip_columns(request)
    if offset == "-1" or not live:
        runs = await load(None)
        inserts = await _messages(ctx, auth.env_id, runs, None, skip)
        return _answer(handle, runs, [*inserts, UP_TO_DATE], live=False)
    since, checksum = _since(offset)
    # a live request reads only the runs changed within GRACE of the offset or after it
    changed_after = datetime.fromtimestamp((since - GRACE_US) / 1_000_000, UTC)
    runs = await load(changed_after)
    hub = ctx.realtime
    if hub is None:
        raise ApiError(503, "unavailable", "realtime is not running in this process")
    loop = asyncio.get_running_loop()
    with ctx.hold("streams", auth.bucket):
        async with hub.watch(watch_key) as changed:
            deadline = loop.time() + LIVE_WAIT_S
            while not (fresh := _changed(runs, since, checksum)):
                remaining = deadline - loop.time()
                if remaining <= 0 or await request.is_disconnected():
                    return _answer(handle, runs, [UP_TO_DATE], live=True, floor=since)
                changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(remaining, 5.0))
                if min_interval_s:  # a busy environment wakes a multi-run shape often: read at most this often
                    await asyncio.sleep(min_interval_s)
                runs = await load(changed_after)
    changes = await _messages(ctx, auth.env_id, fresh, since, skip)
    return _answer(handle, runs, [*changes, UP_TO_DATE], live=True, floor=since)


def _changed(runs: list[RunRow], since: int, checksum: int) -> list[RunRow]:
    """Runs changed after the offset; and, when the runs changed within GRACE before it are not those
    the offset saw (a transaction that began earlier committed later), those too (sent again)."""
    window = _window(runs, since)
    late = window if _checksum(window) != checksum else []
    return late + [r for r in runs if _micros(r.updated_at) > since]
