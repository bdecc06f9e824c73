"""Waitpoint tokens (API.md): create, get, list, complete, and the signed callback URL that an
outside system can POST its result to without an API key."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from run_engine.api import schemas as S
from run_engine.api.auth import token_headers
from run_engine.api.context import ApiContext, ctx_of
from run_engine.api.http import ApiError, body, json_response, page_size, read_json
from run_engine.api.inputs import looks_like_id
from run_engine.api.models import TokenCompleteBody, TokenCreateBody, parse_duration_s
from run_engine.api.openapi import PAGE, Query, operation
from run_engine.api.public import created_bound, csv_values
from run_engine.api.public_tokens import allows, forbidden
from run_engine.api.serialize import iso, pagination
from run_engine.engine import Waitpoint

STATUSES = ("WAITING", "COMPLETED", "TIMED_OUT")


def callback_url(ctx: ApiContext, waitpoint_id: str) -> str:
    return (f"{ctx.public_url}/api/v1/waitpoints/tokens/{waitpoint_id}/callback/"
            f"{ctx.tokens.callback_signature(waitpoint_id)}")


def token_status(wp: Waitpoint) -> str:
    if wp.status == "PENDING":
        return "WAITING"
    return "TIMED_OUT" if wp.output_is_error else "COMPLETED"


def token_object(ctx: ApiContext, wp: Waitpoint) -> dict[str, Any]:
    out: dict[str, Any] = {"id": wp.id, "status": token_status(wp), "outputIsError": wp.output_is_error,
                           "tags": wp.tags, "createdAt": iso(wp.created_at), "url": callback_url(ctx, wp.id)}
    if wp.status == "COMPLETED":
        out["output"] = wp.output
        out["completedAt"] = iso(wp.completed_at)
    if wp.timeout_at is not None:
        out["timeoutAt"] = iso(wp.timeout_at)
    if wp.idempotency_key is not None:
        out["idempotencyKey"] = wp.idempotency_key
    return out


@operation("Create a waitpoint token", S.TokenCreated, body=TokenCreateBody, body_required=False,
           security="apiKeyOrRunToken")
async def create_token(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request, run_token=True)
    req = await body(request, TokenCreateBody, required=False)
    timeout_s = None
    if isinstance(req.timeout, datetime):
        when = req.timeout if req.timeout.tzinfo else req.timeout.replace(tzinfo=UTC)
        timeout_s = max(0.0, when.timestamp() - ctx.engine.now())
    elif req.timeout is not None:
        timeout_s = parse_duration_s(req.timeout)
    ttl_s = parse_duration_s(req.idempotencyKeyTTL) if req.idempotencyKeyTTL is not None else None
    wp, cached = await ctx.engine.create_token(
        auth.env_id, idempotency_key=req.idempotencyKey, idempotency_key_ttl_s=ttl_s, timeout_s=timeout_s,
        tags=req.tags)
    return json_response({"id": wp.id, "isCached": cached, "url": callback_url(ctx, wp.id)},
                         headers=await token_headers(ctx, auth, f"write:waitpoints:{wp.id}", 24 * 3600))


async def _own_token(ctx: ApiContext, env_id: str, waitpoint_id: str) -> Waitpoint:
    wp = await ctx.engine.get_waitpoint(waitpoint_id, env_id) if looks_like_id(waitpoint_id, "waitpoint") else None
    if wp is None or wp.type != "MANUAL":
        raise ApiError(404, "not_found", "waitpoint token not found")
    return wp


@operation("Get a waitpoint token", S.Token, security="apiKeyOrRunToken")
async def get_token(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request, run_token=True)
    token = token_object(ctx, await _own_token(ctx, auth.env_id, request.path_params["waitpoint_id"]))
    if "output" in token and request.headers.get("trigger-version"):
        # Trigger.dev's SDK (it sends its version) reads the output as the serialized packet it parses
        token["output"] = orjson.dumps(token["output"]).decode()
        token["outputType"] = "application/json"
    return json_response(token)


@operation("List waitpoint tokens", S.TokenList,
           query=(Query("filter[status]", {"type": "string", "maxLength": 64}),
                  Query("filter[tags]", {"type": "string", "maxLength": 4096}),
                  Query("filter[idempotencyKey]", {"type": "string", "maxLength": 256}),
                  Query("filter[createdAt][period]", {"type": "string", "maxLength": 32}),
                  Query("filter[createdAt][from]", {"type": "string", "maxLength": 64}),
                  Query("filter[createdAt][to]", {"type": "string", "maxLength": 64}), *PAGE))
async def list_tokens(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    size = page_size(request)
    wanted = {s.strip() for s in request.query_params.get("filter[status]", "").split(",") if s.strip()}
    if bad := wanted - set(STATUSES):
        raise ApiError(400, "invalid_input", f"filter[status]: unknown status {sorted(bad)[0]!r} "
                                             f"(one of {', '.join(STATUSES)})")
    statuses: list[str] = []
    timed_out: bool | None = None
    if wanted and wanted != set(STATUSES):
        if "WAITING" in wanted:
            statuses.append("PENDING")
        if wanted & {"COMPLETED", "TIMED_OUT"}:
            statuses.append("COMPLETED")
            if len(wanted & {"COMPLETED", "TIMED_OUT"}) == 1:
                timed_out = "TIMED_OUT" in wanted
    tags = csv_values(request, "filter[tags]")
    # Trigger.dev's other filters: honoured, never dropped (a caller that looks a token up by its key
    # and completes the first it gets would complete another token)
    key = request.query_params.get("filter[idempotencyKey]") or None
    if key is not None and len(key) > 256:
        raise ApiError(400, "invalid_input", "filter[idempotencyKey]: at most 256 characters")
    created_from, created_to = created_bound(request, "from"), created_bound(request, "to")
    if period := request.query_params.get("filter[createdAt][period]"):
        try:
            since = datetime.fromtimestamp(ctx.engine.now() - parse_duration_s(period[:32]), UTC)
        except ValueError as exc:
            raise ApiError(400, "invalid_input", f"filter[createdAt][period]: {exc}") from None
        created_from = max(created_from, since) if created_from else since
    after = None
    if cursor := request.query_params.get("page[after]"):
        try:
            ts, wp_id = cursor.split("|", 1)
            after = (datetime.fromisoformat(ts), wp_id)
        except ValueError:
            raise ApiError(400, "invalid_input", "page[after]: not a cursor returned by this API") from None
    # fewer than page[size] when their outputs pass PAGE_BYTES (the cursor goes on from there)
    async with ctx.costly_reads.turn(auth.env_id):  # a filter may walk the environment's every token
        page, more = await ctx.engine.list_tokens(auth.env_id, statuses=statuses, timed_out=timed_out, tags=tags,
                                                  idempotency_key=key, created_from=created_from,
                                                  created_to=created_to, limit=size, after=after)
    next_cursor = f"{page[-1].created_at.isoformat()}|{page[-1].id}" if more and page else None
    return json_response({"data": [token_object(ctx, w) for w in page], "pagination": pagination(next_cursor)})


async def complete(ctx: ApiContext, wp: Waitpoint, data: Any) -> None:
    """Complete a token by hand (the first completion wins); 413 over the payload limit."""
    ctx.check_size(data, "data")
    await ctx.engine.complete_waitpoint(wp.id, data)


@operation("Complete a token (the first completion wins)", S.Success, body=TokenCompleteBody, body_required=False,
           security="anyToken")
async def complete_token(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request, run_token=True, public=True)
    waitpoint_id = request.path_params["waitpoint_id"]
    if not allows(auth.scopes, "write:all", "write:waitpoints", f"write:waitpoints:{waitpoint_id}"):
        raise forbidden()
    if not looks_like_id(waitpoint_id, "waitpoint"):
        raise ApiError(404, "not_found", "waitpoint token not found")
    req = await body(request, TokenCompleteBody, required=False)
    ctx.check_size(req.data, "data")
    # the completion itself checks that this is a token of the caller's environment (no read
    # first); one that did not complete is looked up: another's or none (404), or complete already
    if not await ctx.engine.complete_waitpoint(waitpoint_id, req.data, env_id=auth.env_id):
        await _own_token(ctx, auth.env_id, waitpoint_id)
    return json_response({"success": True})


@operation("Complete a token by its signed callback URL (no API key; the body is the output)", S.Success,
           security="none", any_body=True, body_required=False)
async def callback(request: Request) -> Response:
    """No API key: the HMAC signature in the path is the credential; the body is the output."""
    ctx = ctx_of(request)
    waitpoint_id = request.path_params["waitpoint_id"]
    if not ctx.tokens.callback_ok(waitpoint_id, request.path_params["signature"]):
        raise ApiError(401, "unauthorized", "invalid callback signature")
    wp = await ctx.engine.get_waitpoint(waitpoint_id) if looks_like_id(waitpoint_id, "waitpoint") else None
    if wp is None or wp.type != "MANUAL":
        raise ApiError(404, "not_found", "waitpoint token not found")
    # counted against its environment's rate, as every other request of it: a callback URL is
    # handed to outside systems and never expires
    await ctx.check_limit(f"env:{wp.env_id}")
    if wp.status != "PENDING":  # the first completion won: the body is neither read nor written
        return json_response({"success": True})
    data = await read_json(request, required=False)
    await complete(ctx, wp, data)
    return json_response({"success": True})


ROUTES = [
    Route("/api/v1/waitpoints/tokens", create_token, methods=["POST"]),
    Route("/api/v1/waitpoints/tokens", list_tokens, methods=["GET"]),
    Route("/api/v1/waitpoints/tokens/{waitpoint_id}", get_token, methods=["GET"]),
    Route("/api/v1/waitpoints/tokens/{waitpoint_id}/complete", complete_token, methods=["POST"]),
    Route("/api/v1/waitpoints/tokens/{waitpoint_id}/callback/{signature}", callback, methods=["POST"]),
]
