"""Trigger.dev's two-phase batch (its SDK's ``tasks.batchTrigger`` and ``batch.trigger``): open a
batch with the number of runs it will have, then stream its items as NDJSON. Items are triggered
as they are read, each deduplicated by its index (a retried stream triggers nothing twice); the
batch is sealed once every index has been triggered (an item whose idempotency or debounce key
names another batch's run joins that run) or has failed. One bad item never fails the others: a
line that is not a valid item (:mod:`run_engine.api.batch_lines`), or an item refused for its own
input, fails alone, is answered in ``errors`` and kept with the batch (its ``processing.errors``)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from run_engine.api import schemas as S
from run_engine.api.auth import token_headers
from run_engine.api.batch_lines import LineError, read_lines
from run_engine.api.context import ApiContext, ctx_of
from run_engine.api.http import MAX_REQUEST_BYTES, SCAN_OFF_LOOP_BYTES, ApiError, body, json_response, read_body
from run_engine.api.inputs import looks_like_id
from run_engine.api.models import BatchStreamItem, OpenBatchBody, TriggerOptions, parse_duration_s
from run_engine.api.openapi import operation
from run_engine.api.public import trigger_request, with_parent
from run_engine.api.uploads import unpack
from run_engine.engine import BatchItemError, RunRow, TriggeredRun, TriggerRequest
from run_engine.errors import UnprocessableError, ValidationError

log = logging.getLogger(__name__)
#: the engine's refusals of an item for what it asks (HTTP 400 and 422), before any run is made
ITEM_REFUSALS = (ValidationError, UnprocessableError)


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
    raw = await read_body(request, MAX_REQUEST_BYTES)
    # a large body is parsed and walked in a thread: not on the event loop every tenant shares
    lines = await asyncio.to_thread(read_lines, raw, size) if len(raw) > SCAN_OFF_LOOP_BYTES else read_lines(raw, size)
    errors = list(lines.errors)
    # an index makes one run: one sent again (another task, another key, a key's TTL passed) is not,
    # nor one whose run a stream before made and did not note (it died first; or it overlaps this
    # one): the batch's runs are found by their index (task_run.batch_index), and noted again
    run_before = await ctx.engine.batch_indexes_run(batch_id, sorted({item.index for _, item in lines.items}))
    items: list[tuple[int, BatchStreamItem]] = []
    repeated = 0
    taken = set(seen)
    for number, item in lines.items:
        if item.index in taken or item.index in run_before:
            repeated += 1
            taken.add(item.index)
            continue
        taken.add(item.index)
        items.append((number, item))
    # from here on an item refused for its own input fails alone, as a bad line does
    refused: dict[int, ApiError] = {}
    unpacked = await unpack(ctx, auth.env_id, [(item.payload, item.options) for _, item in items],
                            [f"items.{item.index}." for _, item in items], refused)
    requests: list[tuple[int, BatchStreamItem, TriggerRequest]] = []
    parents: dict[str, RunRow] = {}
    for position, ((number, item), (payload, given)) in enumerate(zip(items, unpacked, strict=True)):
        if position in refused:
            errors.append(LineError.of(number, item, refused[position]))
            continue
        options = given or TriggerOptions()
        if options.idempotencyKey is None:  # the index deduplicates a retried stream (kept the default TTL)
            options = options.model_copy(update={"idempotencyKey": f"{batch_id}:{item.index}",
                                                 "idempotencyKeyTTL": None})
        try:
            # a parent must be a run of the caller's environment (refused otherwise), as for any trigger
            asked = await with_parent(ctx, auth, trigger_request(
                ctx, auth, item.task, payload, options, f"items.{item.index}", batch_id=batch_id,
                trigger_function="batchTrigger"), f"items.{item.index}.options.parentRunId", parents)
            requests.append((number, item, dataclasses.replace(asked, batch_index=item.index)))
        except ApiError as exc:
            errors.append(LineError.of(number, item, exc))
    triggered = await _trigger(ctx, requests, errors)  # the batch row exists (phase 1)
    # an index noted failed whose run was made (an overlapping stream) has that failure dropped
    made = [item.index for item, _ in triggered] + sorted(run_before)
    # an item that failed counts as sent (the batch seals without it) unless its index was sent
    # before or made by another line: its first failure, in line order, is kept with the batch
    failed: dict[int, BatchItemError] = {}
    errors.sort(key=lambda e: e.line)
    for error in errors:
        if error.final and error.index is not None and error.index not in seen and error.index not in failed:
            failed[error.index] = error.failure()
    for index in made:
        failed.pop(index, None)
    # sealed once every index was triggered or failed (an item may have joined a run of another
    # batch); a crash before this line is mended by the SDK's retry: its items are deduplicated,
    # its failures found again, then noted
    held = await ctx.engine.note_batch_items(batch_id, made, failed) if made or failed else len(seen)
    cached = sum(1 for _, run in triggered if run.is_cached)
    out: dict[str, Any] = {"id": batch_id, "itemsAccepted": len(triggered) - cached,
                           "itemsDeduplicated": cached + repeated, "sealed": held >= size}
    if held < size:
        out |= {"enqueuedCount": held, "expectedCount": size}
    if errors:
        out["errors"] = [error.answer() for error in errors]
    return json_response(out)


async def _trigger(ctx: ApiContext, requests: list[tuple[int, BatchStreamItem, TriggerRequest]],
                   errors: list[LineError]) -> list[tuple[BatchStreamItem, TriggeredRun]]:
    """Trigger the items' runs in one call; an item the engine refuses for its own input (an unknown
    worker group, a queue past the environment's cap) is added to ``errors`` and the others are
    triggered. Such a refusal creates nothing (every item is checked before any run is made), so
    each item is then checked alone; a refusal none of them has alone is the request's. A debounced
    item that fails once the others' runs were made (its run's lock busy, its key changing hands)
    is added to ``errors`` for the moment only: its index is not noted, so the stream's retry
    triggers it again."""
    if not requests:
        return []
    try:
        runs = await ctx.engine.trigger_each([req for _, _, req in requests])
    except ITEM_REFUSALS:
        kept = []
        for number, item, req in requests:
            try:
                await ctx.engine.check_trigger(req)
            except ITEM_REFUSALS as exc:
                errors.append(LineError.of(number, item, exc))
            else:
                kept.append((number, item, req))
        if len(kept) == len(requests):
            raise
        return await _trigger(ctx, kept, errors)
    made = []
    for (number, item, _), run in zip(requests, runs, strict=True):
        if isinstance(run, Exception):
            error = LineError.of(number, item, run, final=isinstance(run, ITEM_REFUSALS))
            log.log(logging.ERROR if error.status == 500 else logging.WARNING,
                    "batch item %d (line %d) not triggered after the others: %r", item.index, number, run,
                    exc_info=run if error.status == 500 else None)
            errors.append(error)
        else:
            made.append((item, run))
    return made


ROUTES = [
    Route("/api/v3/batches", open_batch, methods=["POST"]),
    Route("/api/v3/batches/{batch_id}/items", stream_items, methods=["POST"]),
]
