"""Trigger.dev's two-phase batch (its SDK's ``tasks.batchTrigger`` and ``batch.trigger``): open a
batch with the number of runs it will have, then stream its items as NDJSON. Items are triggered
as they are read, each deduplicated by its index (a retried stream triggers nothing twice); the
batch is sealed once every index has been triggered (an item whose idempotency or debounce key
names another batch's run joins that run)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from run_engine import jsontext
from run_engine.api import schemas as S
from run_engine.api.auth import token_headers
from run_engine.api.context import ctx_of
from run_engine.api.http import (
    MAX_REQUEST_BYTES,
    SCAN_OFF_LOOP_BYTES,
    ApiError,
    body,
    json_response,
    read_body,
    validate,
)
from run_engine.api.inputs import MAX_CONTAINERS, looks_like_id, needs_scan, unstorable
from run_engine.api.models import BatchStreamItem, OpenBatchBody, TriggerOptions, parse_duration_s
from run_engine.api.openapi import operation
from run_engine.api.public import trigger_request, with_parent
from run_engine.api.uploads import unpack
from run_engine.engine import RunRow


@operation("Open a batch (Trigger.dev's two-phase batch, phase 1)", S.BatchOpened, body=OpenBatchBody)
async def open_batch(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    req = await body(request, OpenBatchBody)
    ttl_s = None if req.idempotencyKeyTTL is None else parse_duration_s(req.idempotencyKeyTTL)
    batch_id, size, cached = await ctx.engine.open_batch(auth.env_id, req.runCount, req.idempotencyKey, ttl_s)
    out: dict[str, Any] = {"id": batch_id, "runCount": size, "isCached": cached}
    if req.idempotencyKey is not None:
        out["idempotencyKey"] = req.idempotencyKey
    return json_response(out, headers=await token_headers(ctx, auth, f"read:batch:{batch_id}", 3600))


def _items(raw: bytes | bytearray, size: int) -> list[BatchStreamItem]:
    lines = bytes(raw).splitlines()
    # counted before any is parsed: a body of a million one-line items would hold the event loop
    # (every tenant's requests) for seconds, while a batch has at most runCount items to send
    if sum(1 for line in lines if line.strip()) > size:
        raise ApiError(400, "invalid_input", f"more items than the batch's runCount {size}: send each index once")
    items: list[BatchStreamItem] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if (brackets := line.count(b"[") + line.count(b"{")) > 2 * MAX_CONTAINERS:
            # more than a payload and its metadata may hold together: refused before it is parsed
            raise ApiError(413, "payload_too_large", f"line {number}: holds {brackets} JSON objects and arrays "
                                                     f"(counting brackets in its strings); a payload and its "
                                                     f"metadata hold at most {MAX_CONTAINERS} each")
        try:
            data = jsontext.loads(line)
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, "invalid_input", f"line {number}: malformed JSON ({exc})") from None
        if needs_scan(line) and (problem := unstorable(data, f"line {number}")) is not None:
            raise ApiError(400, "invalid_input", problem)
        try:
            item = validate(BatchStreamItem, data)
        except ApiError as exc:
            raise ApiError(400, "invalid_input", f"line {number}: {exc.message}") from None
        if item.index >= size:
            raise ApiError(400, "invalid_input", f"line {number}: index {item.index} is not below the batch's "
                                                 f"runCount {size}")
        items.append(item)
    return items


@operation("Stream a batch's items as NDJSON (phase 2); sealed once every run exists", S.BatchItemsStreamed,
           any_body=True)
async def stream_items(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    batch_id = request.path_params["batch_id"]
    # never a run's batchTriggerAndWait batch: its waiting parent would resume on runs not its own
    opened = await ctx.engine.open_batch_items(auth.env_id, batch_id) if looks_like_id(batch_id, "batch") else None
    if opened is None:
        raise ApiError(404, "not_found", "batch not found (or not opened for its items to be sent)")
    size, seen = opened
    # an index makes one run: one sent again (another task, another key, a key's TTL passed) is not
    items, repeated = [], 0
    raw = await read_body(request, MAX_REQUEST_BYTES)
    # a large body is parsed and walked in a thread: not on the event loop every tenant shares
    for item in await asyncio.to_thread(_items, raw, size) if len(raw) > SCAN_OFF_LOOP_BYTES else _items(raw, size):
        if item.index in seen:
            repeated += 1
            continue
        seen.add(item.index)
        items.append(item)
    requests = []
    parents: dict[str, RunRow] = {}
    unpacked = await unpack(ctx, auth.env_id, [(item.payload, item.options) for item in items],
                            [f"items.{item.index}." for item in items])
    for item, (payload, given) in zip(items, unpacked, strict=True):
        options = given or TriggerOptions()
        if options.idempotencyKey is None:  # the index deduplicates a retried stream (kept the default TTL)
            options = options.model_copy(update={"idempotencyKey": f"{batch_id}:{item.index}",
                                                 "idempotencyKeyTTL": None})
        # a parent must be a run of the caller's environment (400 otherwise), as for any trigger
        requests.append(await with_parent(ctx, auth, trigger_request(
            ctx, auth, item.task, payload, options, f"items.{item.index}", batch_id=batch_id,
            trigger_function="batchTrigger"), f"items.{item.index}.options.parentRunId", parents))
    runs = await ctx.engine.trigger_many(requests) if requests else []  # the batch row exists (phase 1)
    deduplicated = sum(1 for r in runs if r.is_cached) + repeated
    # sealed once every index was triggered (an item may have joined a run of another batch); a
    # crash before this line is mended by the SDK's retry: its items are deduplicated, then noted
    held = await ctx.engine.note_batch_items(batch_id, [item.index for item in items]) if items else len(seen)
    out: dict[str, Any] = {"id": batch_id, "itemsAccepted": len(runs) - (deduplicated - repeated),
                           "itemsDeduplicated": deduplicated, "sealed": held >= size}
    if held < size:
        out |= {"enqueuedCount": held, "expectedCount": size}
    return json_response(out)


ROUTES = [
    Route("/api/v3/batches", open_batch, methods=["POST"]),
    Route("/api/v3/batches/{batch_id}/items", stream_items, methods=["POST"]),
]
