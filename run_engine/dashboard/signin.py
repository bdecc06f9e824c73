"""Signing in with an environment's secret API key, and out."""

from __future__ import annotations

import secrets

from starlette.requests import Request
from starlette.responses import Response

from run_engine.api.context import ctx_of
from run_engine.api.http import ApiError
from run_engine.dashboard.core import (
    FLASH_COOKIE,
    SIGN_IN_FORM_BYTES,
    Dash,
    action,
    marks_since,
    read_form,
    redirect,
    render,
    sessions,
    sign_out,
    signed_in,
)
from run_engine.dashboard.session import COOKIE, LIFETIME_S, LOGIN_COOKIE, clear_cookie, same, set_cookie
from run_engine.dependencies import DEPENDENCY_ERRORS, REDIS_DOWN


def _next(value: str | None) -> str:
    """Where signing in goes: a dashboard path, as the page sent it (decoded once already, as a
    query parameter or a form field: decoding it again changed a filter holding % or &)."""
    value = value or ""
    return value if value.startswith("/dashboard/") and not value.startswith("//") else "/dashboard/runs"


def _form(request: Request, *, error: str | None = None, status: int = 200, next_path: str = "") -> Response:
    token = secrets.token_urlsafe(18)
    response = render(request, "login.html", {"title": "Sign in", "login_csrf": token, "error": error,
                                              "next": next_path or _next(request.query_params.get("next"))},
                      status=status, flash="")
    set_cookie(response, request, LOGIN_COOKIE, token, 3600)
    return response


async def login_form(request: Request) -> Response:
    try:
        dash = await signed_in(request)
    except DEPENDENCY_ERRORS:  # the session cannot be checked: the form
        dash = None
    if dash is not None:
        return redirect(request, _next(request.query_params.get("next")))
    return _form(request)


async def login(request: Request) -> Response:
    """``apiKey`` from the form: a session for its environment, or the form again with a 401."""
    ctx = ctx_of(request)
    try:  # before any check: bounded to what a sign-in needs (a signed-in form may be 9 MiB)
        form = await read_form(request, ctx, SIGN_IN_FORM_BYTES)
    except ApiError as exc:
        return _form(request, error=exc.message, status=exc.status)
    next_path = _next(form.get("next"))
    expected = request.cookies.get(LOGIN_COOKIE) or ""
    if not expected or not same(form.get("csrf", ""), expected):
        return _form(request, error="The sign-in form expired: please try again.", status=403, next_path=next_path)
    key = form.get("apiKey", "").strip()
    env = await ctx.environment_by_key(key) if 0 < len(key) <= 256 else None
    if env is None:
        return _form(request, error="That is not an environment's secret API key (tr_dev_…, tr_prod_…).",
                     status=401, next_path=next_path)
    try:  # Redis keeps the session's sign-out from before it opens (or the session would be refused)
        since = await marks_since(ctx.engine)
    except REDIS_DOWN:
        return _form(request, error="Redis is unavailable: sessions cannot be opened now; try again shortly.",
                     status=503, next_path=next_path)
    # opened at the marks' start at the earliest: written from another process's clock, it may be
    # ahead of this one's (by more than the leeway, every session opened here was refused at once)
    _, cookie = sessions(ctx).open(env.id, env.api_key_hash, max(ctx.engine.now(), since))
    response = redirect(request, next_path)
    set_cookie(response, request, COOKIE, cookie, LIFETIME_S)
    clear_cookie(response, request, LOGIN_COOKIE)
    return response


@action
async def logout(request: Request, dash: Dash, form: dict[str, str]) -> Response:
    """Ends the session for every copy of its cookie (Redis keeps it signed out until it would have
    expired). Redis unreachable: 503 and the cookie kept, so that signing out can be tried again
    (a browser told it signed out while a copied cookie still works would be worse)."""
    try:
        await sign_out(dash)
    except REDIS_DOWN:
        raise ApiError(503, "service_unavailable", "Redis is unavailable: the session was not ended; "
                                                   "sign out again once it is back",
                       extra={"dependency": "redis"}, headers={"Retry-After": "2"}) from None
    response = redirect(request, "/dashboard/login")
    for name in (COOKIE, FLASH_COOKIE):
        clear_cookie(response, request, name)
    return response
