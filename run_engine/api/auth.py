"""Public access tokens over HTTP (:mod:`run_engine.api.public_tokens`): the claims the SDK signs a
token with, a token the server signs, and the ``x-trigger-jwt…`` headers a trigger, a batch and a
waitpoint token answer with (the SDK turns them into the ``publicAccessToken`` it returns)."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from run_engine.api import schemas as S
from run_engine.api.context import ApiContext, EnvAuth, ctx_of
from run_engine.api.http import ApiError, body, json_response
from run_engine.api.models import PublicTokenBody, parse_duration_s
from run_engine.api.openapi import operation
from run_engine.api.public_tokens import MAX_LIFETIME_S, MAX_TOKEN_CHARS, mint

DEFAULT_LIFETIME_S = 15 * 60


def _claims(env_id: str) -> dict[str, Any]:
    return {"sub": env_id, "pub": True}


async def token_headers(ctx: ApiContext, auth: EnvAuth, scope: str, lifetime_s: int) -> dict[str, str]:
    """What lets the SDK hand its caller a public token for ``scope``: the claims to sign it with
    when the caller holds the secret key (the SDK signs with it), else a token the server signs."""
    if auth.run_id is None and auth.scopes is None:
        return {"x-trigger-jwt-claims": orjson.dumps(_claims(auth.env_id)).decode()}
    env = await ctx.environment(auth.env_id)
    key = ctx.public_key(env) if env is not None else None
    if key is None:
        return {}
    return {"x-trigger-jwt": mint(key, auth.env_id, [scope], lifetime_s=lifetime_s, now=ctx.engine.now())}


@operation("The claims to sign a public access token with (Trigger.dev's SDK signs it)", S.JwtClaims)
async def jwt_claims(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    return json_response(_claims(auth.env_id))


def _lifetime_s(value: str | int | None, now: float) -> int:
    if value is None:
        return DEFAULT_LIFETIME_S
    if isinstance(value, int):  # a date, in Unix seconds
        seconds = value - now
    else:
        try:
            seconds = parse_duration_s(value)
        except ValueError as exc:
            raise ApiError(400, "invalid_input", f"expirationTime: {exc}") from None
    if not 1 <= seconds <= MAX_LIFETIME_S:
        raise ApiError(400, "invalid_input", f"expirationTime: must be 1 s .. {MAX_LIFETIME_S} s from now")
    return int(seconds)


@operation("A public access token the server signs", S.PublicToken, body=PublicTokenBody)
async def public_token(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    req = await body(request, PublicTokenBody)
    now = ctx.engine.now()
    lifetime_s = _lifetime_s(req.expirationTime, now)
    env = await ctx.environment(auth.env_id)
    key = ctx.public_key(env) if env is not None else None
    if key is None:
        raise ApiError(422, "unprocessable", "this server cannot sign public access tokens for the environment "
                                             "(its API key was not derived from the installation secret)")
    token = mint(key, auth.env_id, list(req.scopes), lifetime_s=lifetime_s, one_time=req.oneTimeUse,
                 realtime=req.realtime, now=now)
    if len(token) > MAX_TOKEN_CHARS:  # signed, it would be refused at every use
        raise ApiError(400, "invalid_input", f"the token would be {len(token)} characters, more than the "
                                             f"{MAX_TOKEN_CHARS} a request may carry: fewer or shorter scopes, or "
                                             "a smaller realtime object")
    return json_response({"token": token})


ROUTES = [
    Route("/api/v1/auth/jwt/claims", jwt_claims, methods=["POST"]),
    Route("/api/v1/auth/public-tokens", public_token, methods=["POST"]),
]
