"""The public API (API.md, "Public API"): environment secret key, run token, or (where a handler
allows it and its scopes say so) a public access token."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from run_engine.api import schemas as S
from run_engine.api.auth import token_headers
from run_engine.api.batch_lines import MAX_MESSAGE
from run_engine.api.context import RUN_TOKEN_SCOPE, ApiContext, EnvAuth, ctx_of
from run_engine.api.http import (
    JSON_PAYLOAD_TYPES,
    ApiError,
    DecodedPayload,
    body,
    decode_json_text,
    error_payload,
    json_response,
    page_size,
)
from run_engine.api.inputs import is_number, looks_like_id, too_large
from run_engine.api.models import (
    BatchBody,
    BatchV2Body,
    ConcurrencyBody,
    MetadataBody,
    PauseBody,
    QueueKindBody,
    RedriveAllBody,
    RescheduleBody,
    TagsBody,
    TriggerBody,
    TriggerOptions,
    metadata_change,
    metadata_digest,
    parse_date,
    parse_duration_s,
    parse_when,
)
from run_engine.api.openapi import PAGE, Query, csv, operation
from run_engine.api.public_tokens import allows, forbidden, read_scopes
from run_engine.api.serialize import explanation_object, iso, pagination, run_object
from run_engine.api.uploads import unpack
from run_engine.engine import BatchItemError, RunRow, TaskQueue, TriggeredRun, TriggerRequest
from run_engine.errors import InvalidTransitionError
from run_engine.statuses import FINAL_RUN_STATUSES, RunStatus

log = logging.getLogger(__name__)

#: the longest ``Idempotency-Key`` of a metadata request (the run's row keeps the last few)
MAX_METADATA_KEY_CHARS = 256


def _decode_payload(payload: Any, payload_type: str | None, field: str) -> Any:
    """Trigger.dev's SDK sends JSON (or superjson) payloads as strings: decode them (the API's
    handlers did already, off the event loop when large: :func:`decode_payload`)."""
    if isinstance(payload, DecodedPayload):
        return payload.value
    if isinstance(payload, str) and payload_type in JSON_PAYLOAD_TYPES:
        return decode_json_text(payload, payload_type, field)
    return payload


def _parent(given: str | None, auth: EnvAuth, field: str) -> str | None:
    """The parent of a triggered run: the run of the caller's run token (a child), or the
    ``parentRunId`` an API key names. A run token cannot name another run as the parent."""
    if auth.run_id is not None:
        if given not in (None, auth.run_id):
            raise ApiError(403, "forbidden", f"{field}: a run token triggers children of its own run only")
        return auth.run_id
    if given is not None and auth.scopes is not None:
        raise ApiError(403, "forbidden", f"{field}: a public access token cannot name a parent run")
    return given


def can_read(auth: EnvAuth, run: RunRow) -> bool:
    """Whether a public access token's scopes let it read ``run`` (any other credential: yes)."""
    return allows(auth.scopes, *read_scopes(run.id, run.task_id, run.tags, run.batch_id))


def _may_trigger(auth: EnvAuth, task: str, action: str) -> None:
    if not allows(auth.scopes, f"{action}:tasks:{task}", f"{action}:tasks", "write:all"):
        raise forbidden()


#: the shapes of the idempotency keys the engine gives the runs it makes itself: a schedule's tick
#: (``schedule:<schedule>:<tick>``), a batch's item (``<batch>:<index>``), a bulk replay's
#: (``<action>:<run>``), and those the SDK gives a run's triggers and batches inside it
#: (``sdk:<run>:<attempt>:…``, the same on every replay of the attempt: known to whoever reads the run)
ENGINE_KEY = re.compile(r"schedule:sched_[a-z0-9]+:.*|(?:batch|bulk)_[a-z0-9]+:.*|" + r"sdk:run_[a-z0-9]+:.*",
                        re.DOTALL)
#: the shape of the batch keys the SDK gives a run's batches inside it
RUN_BATCH_KEY = re.compile(r"sdk:run_[a-z0-9]+:.*", re.DOTALL)
ENGINE_KEY_MESSAGE = ("has the shape of a key the engine gives its own runs (a schedule's tick, a batch's item, "
                      "a bulk replay's, a run's trigger inside it), which only the environment's secret key may name")


def _may_name_key(auth: EnvAuth, options: TriggerOptions | None, field: str) -> None:
    """A public access token names no key of the engine's own runs: a run it triggered with the
    next tick's key of a schedule (shown in its scheduled runs' ``idempotencyKey``) would be the run
    of that tick, with the token holder's payload, and the schedule's would never be made; one it
    triggered with the key a run's next trigger inside it will carry would be that trigger's run."""
    key = options.idempotencyKey if options is not None else None
    if key is not None and auth.scopes is not None and ENGINE_KEY.fullmatch(key):
        raise ApiError(403, "forbidden", f"{field}: {ENGINE_KEY_MESSAGE}")


def trigger_request(ctx: ApiContext, auth: EnvAuth, task: str, payload: Any, options: TriggerOptions | None,
                    field: str, *, batch_id: str | None = None, trigger_function: str = "trigger") -> TriggerRequest:
    o = options or TriggerOptions()
    at = "" if field == "body" else f"{field}."  # field paths as the client wrote them
    payload = _decode_payload(payload, o.payloadType, f"{at}payload")
    ctx.check_size(payload, f"{at}payload")
    # the metadata's own limit, as for each later change of it (PUT …/metadata)
    ctx.check_size(o.metadata, f"{at}options.metadata", limit=ctx.engine.settings.max_metadata_bytes)
    queue_name = o.queue.name if o.queue is not None and not isinstance(o.queue, str) else o.queue
    queue_limit = o.queue.concurrencyLimit if o.queue is not None and not isinstance(o.queue, str) else None
    # a queue's limit holds for every run of the environment that names it: a trigger sets it only
    # with the environment's secret key (Trigger.dev's v3 trigger did, for any caller; v4 has no
    # such option), never a public token's or a run's (it may name the queue, not reconfigure it)
    if queue_limit is not None and _scoped(auth):
        raise ApiError(403, "forbidden", f"{at}options.queue.concurrencyLimit: only the environment's secret key "
                                         "sets a queue's concurrency limit; name the queue alone")
    retry = None
    if o.retry is not None:
        retry = {k: v for k, v in {
            "max_attempts": o.retry.maxAttempts, "factor": o.retry.factor,
            "min_timeout": None if o.retry.minTimeoutInMs is None else o.retry.minTimeoutInMs / 1000,
            "max_timeout": None if o.retry.maxTimeoutInMs is None else o.retry.maxTimeoutInMs / 1000,
            "randomize": o.retry.randomize,
            "out_of_memory": {"machine": o.retry.outOfMemory.machine} if o.retry.outOfMemory else None,
        }.items() if v is not None}
    return TriggerRequest(
        env_id=auth.env_id, task_id=task, payload=payload, payload_type="application/json",
        queue=queue_name, queue_concurrency_limit=queue_limit, concurrency_key=o.concurrencyKey,
        priority_s=o.priority or 0.0, tags=tuple(o.tags or ()), metadata=o.metadata,
        max_attempts=o.maxAttempts, retry=retry,
        max_duration_s=None if o.maxDuration is None else int(o.maxDuration), machine=o.machine,
        parent_run_id=_parent(o.parentRunId, auth, f"{at}options.parentRunId"), batch_id=batch_id,
        trigger_function=trigger_function,
        ttl_s=None if o.ttl is None else parse_duration_s(o.ttl),
        delay_until=None if o.delay is None else parse_when(o.delay, ctx.engine.now()),
        idempotency_key=o.idempotencyKey,
        idempotency_key_ttl_s=None if o.idempotencyKeyTTL is None else parse_duration_s(o.idempotencyKeyTTL),
        # a parent that will wait for this run (wait.for_run): its finish completes its RUN waitpoint
        resume_parent_on_completion=bool(o.resumeParentOnCompletion and (o.parentRunId or auth.run_id)),
        debounce=o.debounce.spec() if o.debounce is not None else None,  # its delay replaces options.delay
        worker_group=o.workerGroup, lock_to_version=o.lockToVersion,
    )


@operation("Trigger a run", S.Triggered, body=TriggerBody, security="anyToken")
async def trigger(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request, run_token=True, public=True)
    task = request.path_params["task_id"]
    if not task or len(task) > 128:
        raise ApiError(400, "invalid_input", "taskId: must be 1..128 characters")
    _may_trigger(auth, task, "trigger")
    req = await body(request, TriggerBody)
    _may_name_key(auth, req.options, "options.idempotencyKey")
    ((payload, options),) = await unpack(ctx, auth.env_id, [(req.payload, req.options)], [""])
    trigger_req = await with_parent(ctx, auth, trigger_request(ctx, auth, task, payload, options, "body"),
                                     "options.parentRunId", {})
    run = await ctx.engine.trigger(trigger_req)
    # A run found by its idempotency or debounce key may be anyone's run of the environment: a
    # caller whose token is scoped (a public token that may only trigger, a run's token) is not
    # handed a token to read it, only its id.
    return json_response({"id": run.id, "isCached": run.is_cached},
                         headers={} if run.is_cached and _scoped(auth) else
                         await token_headers(ctx, auth, f"read:runs:{run.id}", 3600))


async def with_parent(ctx: ApiContext, auth: EnvAuth, req: TriggerRequest, field: str,
                       seen: dict[str, RunRow]) -> TriggerRequest:
    """The request with its parent's root and depth; the parent must be a run of the caller's
    environment (400 otherwise: a run of another tenant is never named a parent)."""
    if not req.parent_run_id:
        return req
    parent = seen.get(req.parent_run_id)
    if parent is None:
        found = (await ctx.engine.get_run(req.parent_run_id, auth.env_id)
                 if looks_like_id(req.parent_run_id, "run") else None)
        if found is None:
            raise ApiError(400, "invalid_input", f"{field}: no such run in this environment")
        parent = seen[req.parent_run_id] = found
    return dataclasses.replace(req, root_run_id=parent.root_run_id or parent.id, depth=parent.depth + 1)


def batch_key(request: Request, auth: EnvAuth) -> tuple[str | None, float | None]:
    """A one-request batch's idempotency key and its TTL in seconds, from the headers Trigger.dev's
    SDK sends them in (``idempotency-key``, ``idempotency-key-ttl``; default 30 days). A public
    access token names no key of the shape the SDK gives a run's batches inside it (that run's
    batch would be the token's)."""
    key = request.headers.get("idempotency-key") or None
    if key is not None and len(key) > MAX_BATCH_KEY_CHARS:
        raise ApiError(400, "invalid_input", f"idempotency-key: at most {MAX_BATCH_KEY_CHARS} characters")
    if key is not None and auth.scopes is not None and RUN_BATCH_KEY.fullmatch(key):
        raise ApiError(403, "forbidden", f"idempotency-key: {ENGINE_KEY_MESSAGE}")
    ttl = request.headers.get("idempotency-key-ttl") or None
    if ttl is None:
        return key, None
    try:
        return key, parse_duration_s(float(ttl) if is_number(ttl) else ttl)
    except ValueError as exc:
        raise ApiError(400, "invalid_input", f"idempotency-key-ttl: {exc}") from None


#: as a trigger's ``options.idempotencyKey`` (an index entry: bounded)
MAX_BATCH_KEY_CHARS = 256


def _scoped(auth: EnvAuth) -> bool:
    """Whether the caller holds less than the environment's secret key: a public access token or a
    run's token."""
    return auth.scopes is not None or auth.run_id is not None


def _maker(auth: EnvAuth) -> str | None:
    """Who makes a batch, as its row keeps it (``batch_task_run.made_by``): a public access token
    by its own identity (a digest of the token: another token, of the same scopes or not, is
    another caller), a run's token by its run (every attempt of the run), the environment's
    secret key None (any holder of it; None is never a token's own batch)."""
    if auth.run_id is not None:
        return f"run:{auth.run_id}"
    if auth.scopes is not None:
        return f"pat:{auth.token_id}" if auth.token_id is not None else None
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class _ItemRun:
    """A batch item's run as the batch endpoints answer it."""

    id: str
    task_id: str
    is_cached: bool


@dataclasses.dataclass(frozen=True, slots=True)
class _ItemFailed:
    """A batch item that made no run, though the others did: a debounced item that failed after the
    other items' runs were committed (its run's lock busy, its key changing hands, an outage then).
    Its index, task, and the error it would have had alone (``exc``: the engine's)."""

    index: int
    task_id: str
    code: str
    message: str
    exc: Exception

    @classmethod
    def of(cls, index: int, task_id: str, exc: Exception) -> _ItemFailed:
        status, data, _ = error_payload(exc)
        log.log(logging.ERROR if status == 500 else logging.WARNING,
                "batch item %d not triggered after the others: %r", index, exc,
                exc_info=exc if status == 500 else None)
        return cls(index, task_id, data["error"]["code"], data["error"]["message"][:MAX_MESSAGE], exc)

    def answer(self) -> dict[str, Any]:
        return {"index": self.index, "taskIdentifier": self.task_id, "error": self.message, "errorCode": self.code}

    def failure(self) -> BatchItemError:
        """As the batch keeps it (``processing.errors``)."""
        return BatchItemError(self.index, self.task_id, self.message.replace("\x00", "\\u0000"), self.code)


_ItemAnswer = _ItemRun | _ItemFailed


def _made_any(answers: Sequence[_ItemAnswer]) -> None:
    """Raise the first item's error when no item has a run: with no other item to answer, the
    request fails as a trigger of that item would (as before one bad item stopped failing the others)."""
    if answers and all(isinstance(a, _ItemFailed) for a in answers):
        raise next(a.exc for a in answers if isinstance(a, _ItemFailed))


async def _trigger_items(ctx: ApiContext, auth: EnvAuth, req: BatchBody, key: str | None = None,
                         key_ttl_s: float | None = None) -> tuple[str, list[_ItemAnswer], bool, bool]:
    """Trigger every item of a batch: one transaction for all of them. With an idempotency key,
    each item without a key of its own is keyed ``{batch id}:{index}``, and the batch the key made
    before (not expired) is answered with its runs (True): see :func:`_cached_batch`. Last, whether
    the caller may read the batch (it made it, or holds the secret key).

    One bad item never fails the others: a debounced item that fails after the other items' runs
    were made is answered in its place (:class:`_ItemFailed`), the others as made. Without an
    idempotency key nothing can make it later (a retry is another batch): it is kept with the batch
    as a failed item (``processing.errors``; it counts as finished). With a key it is a failure of
    the moment, not kept: the retry with the key makes it (see :func:`_cached_batch`)."""
    for task in {item.task for item in req.items}:
        _may_trigger(auth, task, "batchTrigger")
    if key is None:
        batch_id = ctx.engine.new_batch_id()
        requests = await _item_requests(ctx, auth, req, batch_id, range(len(req.items)), keyed=False)
        runs = await ctx.engine.trigger_batch_each(auth.env_id, batch_id, requests)
        answers = _answers(range(len(req.items)), requests, runs)
        _made_any(answers)
        if failed := {a.index: a.failure() for a in answers if isinstance(a, _ItemFailed)}:
            try:
                await ctx.engine.note_batch_items(batch_id, [], failed)
            except Exception:  # the runs were made and the failure is answered: only its record is lost
                log.warning("batch %s: its failed items %s not kept", batch_id, sorted(failed), exc_info=True)
        return batch_id, answers, False, True
    batch_id, size, cached = await ctx.engine.open_batch(auth.env_id, len(req.items), key, key_ttl_s,
                                                         two_phase=False, made_by=_maker(auth))
    if size != len(req.items):  # a scoped caller learns no more of another's batch than that it is there
        raise ApiError(409, "conflict", "idempotency-key: names a batch of another number of items" if _scoped(auth)
                       else f"idempotency-key: names a batch of {size} items, not {len(req.items)}")
    if cached:
        answers, own = await _cached_batch(ctx, auth, req, batch_id, key_ttl_s)
        return batch_id, answers, True, own
    # the batch's row was made with its key (and its maker): its runs now
    try:
        requests = await _item_requests(ctx, auth, req, batch_id, range(len(req.items)), keyed=True,
                                        key_ttl_s=key_ttl_s)
        answers = _answers(range(len(req.items)), requests, await ctx.engine.trigger_each(requests))
        _made_any(answers)
    except Exception:
        # refused (a bad item, a queue past its cap or full, an outage) before any run was made:
        # the key is freed, so that its retry makes the batch anew, whoever sends it (a batch
        # found by its key is made whole for its maker and the secret key only). A process that
        # dies here frees nothing: the maker's retry makes the runs (see _cached_batch)
        try:
            await ctx.engine.release_empty_batch_key(auth.env_id, batch_id)
        except Exception:
            log.warning("batch %s: its key not freed after its request failed", batch_id, exc_info=True)
        raise
    return batch_id, answers, False, True


async def _cached_batch(ctx: ApiContext, auth: EnvAuth, req: BatchBody,
                        batch_id: str, key_ttl_s: float | None = None) -> tuple[list[_ItemAnswer], bool]:
    """The answer to a batch whose idempotency key found the batch ``batch_id`` it made before, and
    whether the caller is the batch's own (the secret key, or the credential that made it).

    A batch key is the environment's, not a task's: the request may not be the one that made the
    batch (other tasks, other keys; a caller holding only a public or run token that names another
    party's key). It never adds runs that are not the batch's own. When every item finds its run
    in the batch (at its index, ``{batch}:{index}``, of the item's task; or, for an item with its
    own ``idempotencyKey``, the batch's run of its task holding that key), those, by position.
    Items with none are made (the first attempt died between the batch's row and its runs, or
    the item joined a run outside the batch by its own key or debounce key, which its retry joins
    again) when every run of the batch is one of the items' (the request is the batch's own) and
    the caller made the batch (the same public token or run, ``batch_task_run.made_by``) or holds
    the environment's secret key. Any other caller (whose scopes cannot be shown to cover the
    tasks the batch was made of; a row without a maker, made before it was kept or by a process
    that does not keep it, is never a token's) makes none: the items without a run in the batch
    are answered with the runs their own keys hold outside it, as a trigger with that key would
    be, and when an item has none, 409. Another request (a run of the batch at an item's index of
    another task, or that no item names) is answered with the batch's runs as they are for its
    own, 409 for any other caller. The runs found are all ``isCached``. An item made now that fails
    after the others' runs were made is answered in its place (:class:`_ItemFailed`), not kept:
    the next retry makes it."""
    size = len(req.items)
    own = not _scoped(auth)
    if not own and (maker := _maker(auth)) is not None:  # a row without a maker is no token's
        record = await ctx.engine.batch_record(auth.env_id, batch_id)
        own = record is not None and record.made_by == maker
    # newest first; a batch has at most one run an item (one more shows that it is not one of these)
    stored = list(reversed(await ctx.engine.list_runs(auth.env_id, batches=[batch_id], limit=size + 1,
                                                      light=True)))
    prefix = f"{batch_id}:"
    at: dict[int, RunRow] = {}
    others: list[RunRow] = []
    mismatch = len(stored) > size
    for run in stored:
        held = run.idempotency_key or ""
        index = held[len(prefix):] if held.startswith(prefix) else ""
        if index.isdecimal() and int(index) < size and int(index) not in at:
            at[int(index)] = run
        else:
            others.append(run)
    found: list[RunRow | None] = []
    for i, item in enumerate(req.items):
        mine_key = _own_key(item.options)
        mine = at.get(i)
        if mine is not None:
            mismatch |= mine_key is not None or mine.task_id != item.task
        elif mine_key is not None:
            mine = next((r for r in others if r.task_id == item.task and r.idempotency_key == mine_key), None)
        found.append(mine)
    mismatch |= len({r.id for r in found if r is not None}) < len(stored)  # a run of the batch no item names
    if not mismatch and all(r is not None for r in found):
        return [_ItemRun(r.id, r.task_id, True) for r in found if r is not None], own
    if mismatch:
        if not own:  # maybe another party's batch: that the key is taken is all it learns
            raise ApiError(409, "conflict", "idempotency-key: names a batch made of other items")
        return [_ItemRun(r.id, r.task_id, True) for r in _in_order(at, others)], own
    missing = [i for i, r in enumerate(found) if r is None]
    if own:
        requests = await _item_requests(ctx, auth, req, batch_id, missing, keyed=True, key_ttl_s=key_ttl_s)
        made = dict(zip(missing, _answers(missing, requests, await ctx.engine.trigger_each(requests)), strict=True))
        answers: list[_ItemAnswer] = [made[i] if r is None else _ItemRun(r.id, r.task_id, True)
                                      for i, r in enumerate(found)]
        _made_any(answers)
        return answers, own
    # another caller's batch of these items: the runs outside it that the items' own keys joined
    keys = [(req.items[i].task, k) for i in missing if (k := _own_key(req.items[i].options)) is not None]
    held_by = await ctx.engine.runs_holding_keys(auth.env_id, keys)
    answers = []
    for item, in_batch in zip(req.items, found, strict=True):
        mine_key = _own_key(item.options)
        holder = in_batch if in_batch is not None or mine_key is None else held_by.get((item.task, mine_key))
        if holder is None:
            raise ApiError(409, "conflict", "idempotency-key: names a batch not all of whose runs were made, which "
                                            "only the credential that made it or the environment's secret key "
                                            "may make")
        answers.append(_ItemRun(holder.id, holder.task_id, True))
    return answers, own


def _own_key(options: TriggerOptions | None) -> str | None:
    """A batch item's own ``idempotencyKey``, if it has one."""
    return options.idempotencyKey if options is not None else None


def _in_order(at: dict[int, RunRow], others: list[RunRow]) -> list[RunRow]:
    """A batch's runs: those keyed by their index in its order, then the others oldest first."""
    return [at[i] for i in sorted(at)] + others


async def _item_requests(ctx: ApiContext, auth: EnvAuth, req: BatchBody, batch_id: str, indexes: Sequence[int], *,
                         keyed: bool, key_ttl_s: float | None = None) -> list[TriggerRequest]:
    """The trigger requests of the batch's items at ``indexes``; ``keyed``: each without a key of
    its own keyed ``{batch id}:{index}``, so that a retry makes no run twice, for as long as the
    batch's key (``key_ttl_s``; the default, 30 days, when None): a run is kept by retention while
    its key holds, and a batch keyed for an hour kept its runs a month."""
    parents: dict[str, RunRow] = {}
    top: dict[str, Any] = {}
    if isinstance(req, BatchV2Body) and req.parentRunId is not None:  # the parent of every item
        top = {"parentRunId": req.parentRunId, "resumeParentOnCompletion": bool(req.resumeParentOnCompletion)}
    items = [req.items[i] for i in indexes]
    unpacked = await unpack(ctx, auth.env_id, [(item.payload, item.options) for item in items],
                            [f"items.{i}." for i in indexes])
    requests = []
    for i, item, (payload, options) in zip(indexes, items, unpacked, strict=True):
        _may_name_key(auth, options, f"items.{i}.options.idempotencyKey")
        if top:
            options = (options or TriggerOptions()).model_copy(update=top)
        if keyed and (options is None or options.idempotencyKey is None):
            options = (options or TriggerOptions()).model_copy(update={"idempotencyKey": f"{batch_id}:{i}",
                                                                       "idempotencyKeyTTL": key_ttl_s})
        requests.append(await with_parent(ctx, auth, trigger_request(ctx, auth, item.task, payload, options,
                                                                      f"items.{i}", batch_id=batch_id,
                                                                      trigger_function="batchTrigger"),
                                           f"items.{i}.options.parentRunId", parents))
    return requests


def _answers(indexes: Sequence[int], requests: Sequence[TriggerRequest],
             runs: Sequence[TriggeredRun | Exception]) -> list[_ItemAnswer]:
    """The run of each item (at ``indexes`` of the batch), or its failure."""
    return [_ItemFailed.of(i, q.task_id, r) if isinstance(r, Exception) else _ItemRun(r.id, q.task_id, r.is_cached)
            for i, q, r in zip(indexes, requests, runs, strict=True)]


async def _batch_token(ctx: ApiContext, auth: EnvAuth, batch_id: str, own: bool) -> dict[str, str]:
    """The headers that let the caller read the batch (``x-trigger-jwt-claims`` or ``x-trigger-jwt``):
    none for a scoped caller whose key found a batch another credential made, which may be another
    party's (as a single trigger's run found by its key: its id is all such a caller learns)."""
    if not own:
        return {}
    return await token_headers(ctx, auth, f"read:batch:{batch_id}", 3600)


@operation("Trigger a batch of runs (1..1000 items; headers idempotency-key, idempotency-key-ttl)",
           S.BatchTriggered, body=BatchBody, security="anyToken")
async def batch_trigger(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request, run_token=True, public=True)
    key, ttl_s = batch_key(request, auth)
    batch_id, answers, _, own = await _trigger_items(ctx, auth, await body(request, BatchBody), key, ttl_s)
    # an item that failed alone has no run: the runs are the other items', in their order
    out: dict[str, Any] = {"id": batch_id, "runs": [
        {"id": r.id, "taskIdentifier": r.task_id, "isCached": r.is_cached} for r in answers if isinstance(r, _ItemRun)]}
    return json_response(out | _errors(answers), headers=await _batch_token(ctx, auth, batch_id, own))


def _errors(answers: Sequence[_ItemAnswer]) -> dict[str, Any]:
    """``errors``: the items that failed alone, by index (left out when there are none)."""
    failed = [a.answer() for a in answers if isinstance(a, _ItemFailed)]
    return {"errors": failed} if failed else {}


#: ``batch-processing-strategy`` of Trigger.dev's one-request batch: both are accepted and neither
#: changes the outcome, as every run of the batch is made in one transaction (none before the others)
STRATEGIES = ("parallel", "sequential")


@operation("Trigger a batch of runs in one request (Trigger.dev's v2 batch; headers batch-processing-strategy, "
           "idempotency-key, idempotency-key-ttl)",
           S.BatchV2Triggered, body=BatchV2Body, security="anyToken")
async def batch_trigger_v2(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request, run_token=True, public=True)
    strategy = request.headers.get("batch-processing-strategy") or "parallel"
    if strategy not in STRATEGIES:
        raise ApiError(400, "invalid_input", f"batch-processing-strategy: one of {', '.join(STRATEGIES)}")
    key, ttl_s = batch_key(request, auth)
    req = await body(request, BatchV2Body)
    batch_id, answers, cached, own = await _trigger_items(ctx, auth, req, key, ttl_s)
    # the batch's number of items (a cached batch's runs may be fewer: items that joined others' runs)
    out: dict[str, Any] = {"id": batch_id, "runCount": len(req.items), "isCached": cached}
    if key is not None:
        out["idempotencyKey"] = key
    return json_response(out | _errors(answers), headers=await _batch_token(ctx, auth, batch_id, own))


@operation("Get a batch", S.Batch, security="anyToken")
async def get_batch(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request, run_token=True, public=True)
    batch_id, runs = await _batch_runs(ctx, auth, request)
    if not runs:
        raise ApiError(404, "not_found", "batch not found")
    done = all(RunStatus(r.status) in FINAL_RUN_STATUSES for r in runs)
    return json_response({"id": batch_id, "status": "COMPLETED" if done else "PENDING", "runCount": len(runs),
                          "runs": [r.id for r in reversed(runs)]})


@operation("Get a batch, as Trigger.dev's SDK's batch.retrieve reads it", S.BatchV2, security="anyToken")
async def get_batch_v2(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request, run_token=True, public=True)
    batch_id, runs = await _batch_runs(ctx, auth, request)
    made = await ctx.engine.batch_record(auth.env_id, batch_id)
    if made is None and not runs:
        raise ApiError(404, "not_found", "batch not found")
    if auth.run_id is not None and not runs and made is not None and made.parent_run_id != auth.run_id:
        raise ApiError(403, "forbidden", f"a run token may only {RUN_TOKEN_SCOPE}")
    size = max(made.size if made else 0, len(runs))
    # a two-phase batch whose items are still being sent (an item that joined another batch's run
    # by its idempotency key counts as sent, not as a run of this one); past the grace the sweep
    # gives a batch to be made whole, it never will be (a waiting parent was answered
    # BATCH_INCOMPLETE): ABORTED, as Trigger.dev's, a final status a poller stops at
    if made is not None and made.two_phase and made.items_seen < made.size:
        waited = ctx.engine.now() - made.created_at.timestamp()
        status = "PROCESSING" if waited < ctx.engine.settings.batch_creation_grace_s else "ABORTED"
    else:
        status = "COMPLETED" if all(RunStatus(r.status) in FINAL_RUN_STATUSES for r in runs) else "PENDING"
    created = made.created_at if made else min(r.created_at for r in runs)
    out: dict[str, Any] = {
        "id": batch_id, "status": status, "createdAt": iso(created),
        "updatedAt": iso(max([created, *(r.updated_at for r in runs)])), "runCount": size,
        "runs": [r.id for r in reversed(runs)],
        # an item that failed on its own: a streamed one, or a one-request batch's debounced item that
        # failed after the others' runs were made (an item refused for its input fails its request)
        "processing": {"errors": [{"index": e.index, "taskIdentifier": e.task_id, "error": e.message,
                                   "errorCode": e.code} for e in (made.item_errors if made else ())]}}
    if made is not None and made.idempotency_key is not None:
        out["idempotencyKey"] = made.idempotency_key
    return json_response(out)


async def _batch_runs(ctx: ApiContext, auth: EnvAuth, request: Request) -> tuple[str, list[RunRow]]:
    """The batch's id and its runs (newest first, light), for a caller allowed to read them."""
    batch_id = request.path_params["batch_id"]
    if not allows(auth.scopes, "read:all", "read:runs", f"read:batch:{batch_id}"):
        raise forbidden()
    if not looks_like_id(batch_id, "batch"):
        raise ApiError(404, "not_found", "batch not found")
    runs = await ctx.engine.list_runs(auth.env_id, batches=[batch_id], limit=1000, light=True)
    if auth.run_id is not None and any(r.parent_run_id != auth.run_id for r in runs):
        raise ApiError(403, "forbidden", f"a run token may only {RUN_TOKEN_SCOPE}")
    return batch_id, runs


async def _own_run(ctx: ApiContext, auth: EnvAuth, run_id: str) -> RunRow:
    run = await ctx.engine.get_run(run_id, auth.env_id) if looks_like_id(run_id, "run") else None
    if run is None:
        raise ApiError(404, "not_found", "run not found")
    return run


@operation("Get a run", S.Run, security="anyToken")
async def get_run(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request, run_token=True, public=True)
    run = await _own_run(ctx, auth, request.path_params["run_id"])
    if auth.run_id is not None and auth.run_id not in (run.id, run.parent_run_id):
        raise ApiError(403, "forbidden", f"a run token may only {RUN_TOKEN_SCOPE}")
    if not can_read(auth, run):
        raise forbidden()
    return json_response(run_object(run, children=await ctx.engine.child_runs(run.id)))


def csv_values(request: Request, name: str) -> list[str]:
    """A filter's comma-separated values: at most 100 of at most 256 characters (400 otherwise:
    each value costs the query a comparison per row it reads)."""
    raw = request.query_params.get(name)
    values = [v.strip() for v in raw.split(",") if v.strip()] if raw else []
    if len(values) > 100 or any(len(v) > 256 for v in values):
        raise ApiError(400, "invalid_input", f"{name}: at most 100 values of at most 256 characters")
    return values


def created_bound(request: Request, end: str) -> datetime | None:
    """``filter[createdAt][from|to]``: an ISO 8601 date (UTC if naive); ``to`` is exclusive."""
    name = f"filter[createdAt][{end}]"
    raw = request.query_params.get(name)
    if not raw:
        return None
    try:
        return parse_date(raw[:64])
    except ValueError as exc:
        raise ApiError(400, "invalid_input", f"{name}: {exc}") from None


def _cursor(run: RunRow) -> str:
    return f"{run.created_at.isoformat()}|{run.id}"


@operation("List runs, newest first", S.RunList,
           query=(csv("filter[status]"), csv("filter[taskIdentifier]"), csv("filter[tag]"), csv("filter[queue]"),
                  csv("filter[batch]"), Query("filter[createdAt][from]", {"type": "string", "maxLength": 64}),
                  Query("filter[createdAt][to]", {"type": "string", "maxLength": 64}), *PAGE))
async def list_runs(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    size = page_size(request)
    statuses = csv_values(request, "filter[status]")
    for s in statuses:
        if s not in RunStatus.__members__:
            raise ApiError(400, "invalid_input", f"filter[status]: unknown status {s!r}")
    after = None
    if cursor := request.query_params.get("page[after]"):
        try:
            ts, run_id = cursor.split("|", 1)
            after = (datetime.fromisoformat(ts), run_id)
        except ValueError:
            raise ApiError(400, "invalid_input", "page[after]: not a cursor returned by this API") from None
    tasks, tags = csv_values(request, "filter[taskIdentifier]"), csv_values(request, "filter[tag]")
    queues, batches = csv_values(request, "filter[queue]"), csv_values(request, "filter[batch]")
    created_from, created_to = created_bound(request, "from"), created_bound(request, "to")
    # fewer than page[size] when the runs' payloads and outputs pass PAGE_BYTES (the cursor goes on);
    # in the environment's turn: a filter may walk its every run (a tag of a million runs)
    async with ctx.costly_reads.turn(auth.env_id):
        page, more = await ctx.engine.page_runs(
            auth.env_id, statuses=statuses, tasks=tasks, tags=tags, queues=queues, batches=batches, limit=size,
            after=after, created_from=created_from, created_to=created_to)
    env = await ctx.environment(auth.env_id)
    where = {"id": auth.env_id, "name": env.slug if env else auth.env_id}  # Trigger.dev's list items carry it
    return json_response({"data": [{**run_object(r), "env": where} for r in page],
                          "pagination": pagination(_cursor(page[-1]) if more and page else None)})


@operation("Cancel a run (and the children it waits on); no-op when finished", S.RunId)
async def cancel_run(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    run = await _own_run(ctx, auth, request.path_params["run_id"])
    await ctx.engine.cancel(run.id)
    return json_response({"id": run.id})


@operation("Replay a run: a new run with the same task, payload and options", S.RunId)
async def replay_run(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    run = await _own_run(ctx, auth, request.path_params["run_id"])
    new = await ctx.engine.replay(run)
    return json_response({"id": new.id})


# --- queues -------------------------------------------------------------------------------------

async def queue_object(ctx: ApiContext, row: TaskQueue) -> dict[str, Any]:
    stats = await ctx.engine.queue_stats(row.env_id, row.name)
    return _queue_json(row, stats.queued, stats.running)


async def queue_objects(ctx: ApiContext, env_id: str, rows: Sequence[TaskQueue]) -> list[dict[str, Any]]:
    """The queues' objects, their counts read in one round trip (an environment may have 10,000)."""
    counts = await ctx.engine.queue_counts(env_id, [r.name for r in rows])
    return [_queue_json(r, queued, running) for r, (queued, running) in zip(rows, counts, strict=True)]


def _queue_json(row: TaskQueue, queued: int, running: int) -> dict[str, Any]:
    return {"id": row.id, "name": row.name, "type": row.type, "running": running,
            "queued": queued, "concurrencyLimit": row.effective_limit, "paused": row.paused,
            "concurrencyLimitOverridden": row.concurrency_limit_override is not None,
            "rateLimit": row.rate_limit.stored() if row.rate_limit else None}


async def _queue_row(ctx: ApiContext, auth: EnvAuth, name: str, kind: str | None = None) -> TaskQueue:
    """The queue a path names: by name (``kind`` None or ``custom``), by task id (``task``: the
    queue ``task/<id>``) or by its id (``id``), as Trigger.dev's SDK sends them."""
    row = None
    if kind is not None:  # the SDK sends a slash of a name as %2F, encoded once more
        name = name.replace("%2F", "/").replace("%2f", "/")
    if kind == "id":  # one row, not the environment's every queue (it may have 10,000)
        row = await ctx.engine.queue_by_id(auth.env_id, name) if looks_like_id(name, "queue") else None
    else:
        if kind == "task" and not name.startswith("task/"):
            name = f"task/{name}"
        row = await ctx.engine.task_queue(auth.env_id, name)
    if row is None:
        raise ApiError(404, "not_found", "queue not found")
    return row


def _kind(request: Request) -> str | None:
    kind = request.query_params.get("type")
    if kind not in (None, "task", "custom", "id"):
        raise ApiError(400, "invalid_input", "type: task, custom or id")
    return kind


@operation("List queues (all, or page numbers with page and perPage)", S.QueueList,
           query=(Query("page", {"type": "integer", "minimum": 1}),
                  Query("perPage", {"type": "integer", "minimum": 1, "maximum": 1000})))
async def list_queues(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    number, per_page = request.query_params.get("page", "1"), request.query_params.get("perPage")
    if not is_number(number) or int(number) < 1 or (per_page is not None and not (
            is_number(per_page) and 1 <= int(per_page) <= 1000)):
        raise ApiError(400, "invalid_input", "page: an integer from 1; perPage: an integer 1..1000")
    # in the environment's turn: its queues (up to RUN_ENGINE_MAX_QUEUES_PER_ENV, 10,000) are read
    # and each counted in Redis, a cost its own data decides
    async with ctx.costly_reads.turn(auth.env_id):
        rows = await ctx.engine.list_queues(auth.env_id)
        size = int(per_page) if per_page else max(1, len(rows))
        start = (int(number) - 1) * size
        data = await queue_objects(ctx, auth.env_id, rows[start:start + size])
    return json_response({"data": data, "pagination": {
        "currentPage": int(number), "totalPages": max(1, -(-len(rows) // size)), "count": len(rows)}})


@operation("Get a queue", S.Queue, query=(Query("type", {"type": "string", "enum": ["task", "custom", "id"]}),))
async def get_queue(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    return json_response(await queue_object(ctx, await _queue_row(ctx, auth, request.path_params["name"],
                                                                  _kind(request))))


@operation("Pause or resume a queue", S.Queue, body=PauseBody)
async def pause_queue(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    req = await body(request, PauseBody)
    name = (await _queue_row(ctx, auth, request.path_params["name"], req.type)).name
    if req.action == "pause":
        await ctx.engine.pause_queue(auth.env_id, name)
    else:
        await ctx.engine.resume_queue(auth.env_id, name)
    return json_response(await queue_object(ctx, await _queue_row(ctx, auth, name)))


@operation("Override the concurrency limit", S.Queue, body=ConcurrencyBody)
async def override_concurrency(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    req = await body(request, ConcurrencyBody)
    name = (await _queue_row(ctx, auth, request.path_params["name"], req.type)).name
    row = await ctx.engine.set_queue_concurrency_override(auth.env_id, name, req.concurrencyLimit)
    return json_response(await queue_object(ctx, row))


@operation("Reset the concurrency limit to the deployed one", S.Queue, body=QueueKindBody, body_required=False)
async def reset_concurrency(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    req = await body(request, QueueKindBody, required=False)
    name = (await _queue_row(ctx, auth, request.path_params["name"], req.type)).name
    row = await ctx.engine.set_queue_concurrency_override(auth.env_id, name, None)
    return json_response(await queue_object(ctx, row))


# --- DLQ ----------------------------------------------------------------------------------------

@operation("List dead-lettered runs", S.DlqList,
           query=(Query("filter[taskIdentifier]", {"type": "string", "maxLength": 4096}),
                  Query("filter[queue]", {"type": "string", "maxLength": 4096}), *PAGE))
async def list_dlq(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    size = page_size(request)
    tasks, queues = set(csv_values(request, "filter[taskIdentifier]")), set(csv_values(request, "filter[queue]"))
    dead, following = await ctx.engine.list_dead(auth.env_id, size, request.query_params.get("page[after]"), tasks,
                                                 queues)
    data = [{"run": run_object(d.run), "reason": d.entry.reason, "deadAt": iso(_ms(d.entry.dead_at_ms)),
             "deliveries": d.entry.deliveries} for d in dead]
    return json_response({"data": data, "pagination": pagination(following)})


def _ms(ms: int) -> datetime:
    from datetime import UTC

    return datetime.fromtimestamp(ms / 1000, UTC)


@operation("Redrive one dead-lettered run", S.RunId)
async def redrive_one(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    run = await _own_run(ctx, auth, request.path_params["run_id"])
    try:
        await ctx.engine.redrive(auth.env_id, run.id)
    except InvalidTransitionError:
        raise ApiError(409, "not_dead_lettered", "the run is not in the dead-letter queue") from None
    return json_response({"id": run.id})


@operation("Redrive every matching dead-lettered run", S.Redriven, body=RedriveAllBody, body_required=False)
async def redrive_all(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    req = await body(request, RedriveAllBody, required=False)
    count, next_cursor = await ctx.engine.redrive_all(
        auth.env_id, [req.taskIdentifier] if req.taskIdentifier is not None else (),
        [req.queue] if req.queue is not None else (), req.after)
    # a bounded part of the DLQ a call: `next` (only then) is where the next call goes on
    return json_response({"redriven": count} | ({"next": next_cursor} if next_cursor else {}))


@operation("Reschedule a delayed run (422 unless DELAYED)", S.Run, body=RescheduleBody)
async def reschedule_run(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    run = await _own_run(ctx, auth, request.path_params["run_id"])
    req = await body(request, RescheduleBody)
    when = parse_when(req.delay, ctx.engine.now())
    try:
        fresh = await ctx.engine.reschedule(auth.env_id, run.id, when)
    except InvalidTransitionError:
        raise ApiError(422, "not_delayed", f"run {run.id} is {run.status}: only a DELAYED run can be "
                                           "rescheduled") from None
    return json_response(run_object(fresh))


@operation("Why a QUEUED or DELAYED run has not started", S.Explanation)
async def explain_run(request: Request) -> Response:
    """Why a QUEUED or DELAYED run has not started, with the numbers."""
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    return json_response(explanation_object(await ctx.engine.explain(auth.env_id, request.path_params["run_id"])))


@operation("Replace a run's metadata, or change it (and its parent's and root's) by operations (header "
           "Idempotency-Key: a request sent again is applied once)", S.MetadataOut,
           body=MetadataBody, security="apiKeyOrRunToken")
async def update_metadata(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request, run_token=True)
    run = await _own_run(ctx, auth, request.path_params["run_id"])
    if auth.run_id is not None and auth.run_id != run.id:
        raise ApiError(403, "forbidden", f"a run token may only {RUN_TOKEN_SCOPE}")
    # the SDK's flush sends one with each request, and the same again when it tries it again
    key = request.headers.get("idempotency-key") or None
    if key is not None and len(key) > MAX_METADATA_KEY_CHARS:
        raise ApiError(400, "invalid_input", f"Idempotency-Key: at most {MAX_METADATA_KEY_CHARS} characters")
    req = await body(request, MetadataBody)
    # every operation checked before anything is read or written
    change = metadata_change(req, keyed=key is not None)
    limit = ctx.engine.settings.max_metadata_bytes
    if (req.operations is None and req.metadata is not None
            and (large := too_large(orjson.dumps(req.metadata), limit)) is not None):
        raise ApiError(413, "payload_too_large", f"metadata: {large}")
    if change is None:
        await ctx.engine.set_metadata(auth.env_id, run.id, req.metadata)
        return json_response({"metadata": req.metadata})
    # the run's parent and root are those its row names (never the body's): a run token reaches
    # them only through these operations
    keyed = (key, metadata_digest(req)) if key is not None else None
    return json_response({"metadata": await ctx.engine.change_metadata(run, *change, request=keyed)})


@operation("Add tags to a run (at most 10)", S.TagsOut, body=TagsBody, security="apiKeyOrRunToken")
async def add_tags(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request, run_token=True)
    run = await _own_run(ctx, auth, request.path_params["run_id"])
    if auth.run_id is not None and auth.run_id != run.id:
        raise ApiError(403, "forbidden", f"a run token may only {RUN_TOKEN_SCOPE}")
    req = await body(request, TagsBody)
    tags = await ctx.engine.add_tags(auth.env_id, run.id, list(req.tags), 10)
    if tags is None:
        raise ApiError(422, "too_many_tags", "a run has at most 10 tags")
    out: dict[str, Any] = {"tags": tags}
    if request.headers.get("trigger-version"):  # Trigger.dev's SDK reads a message
        out["message"] = f"the run has {len(tags)} tags"
    return json_response(out)


ROUTES = [
    Route("/api/v1/tasks/batch", batch_trigger, methods=["POST"]),
    Route("/api/v2/tasks/batch", batch_trigger_v2, methods=["POST"]),
    Route("/api/v1/tasks/{task_id}/trigger", trigger, methods=["POST"]),
    Route("/api/v1/batches/{batch_id}", get_batch, methods=["GET"]),
    Route("/api/v2/batches/{batch_id}", get_batch_v2, methods=["GET"]),
    Route("/api/v3/runs/{run_id}", get_run, methods=["GET"]),
    Route("/api/v1/runs", list_runs, methods=["GET"]),
    Route("/api/v2/runs/{run_id}/cancel", cancel_run, methods=["POST"]),
    Route("/api/v1/runs/{run_id}/replay", replay_run, methods=["POST"]),
    Route("/api/v1/runs/{run_id}/reschedule", reschedule_run, methods=["POST"]),
    Route("/api/v1/runs/{run_id}/explain", explain_run, methods=["GET"]),
    Route("/api/v1/runs/{run_id}/metadata", update_metadata, methods=["PUT"]),
    Route("/api/v1/runs/{run_id}/tags", add_tags, methods=["POST"]),
    Route("/api/v1/queues", list_queues, methods=["GET"]),
    Route("/api/v1/queues/{name:path}/pause", pause_queue, methods=["POST"]),
    Route("/api/v1/queues/{name:path}/concurrency/override", override_concurrency, methods=["POST"]),
    Route("/api/v1/queues/{name:path}/concurrency/reset", reset_concurrency, methods=["POST"]),
    Route("/api/v1/queues/{name:path}", get_queue, methods=["GET"]),
    Route("/api/v1/dlq", list_dlq, methods=["GET"]),
    Route("/api/v1/dlq/redrive", redrive_all, methods=["POST"]),
    Route("/api/v1/dlq/{run_id}/redrive", redrive_one, methods=["POST"]),
]
