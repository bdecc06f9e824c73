"""What every dashboard page needs: the signed-in environment, templates, forms, redirects."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote

import jinja2
import orjson
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from run_engine.api.context import ApiContext, EnvAuth, ctx_of
from run_engine.api.http import SCAN_OFF_LOOP_BYTES, ApiError, error_payload, read_body
from run_engine.dashboard.session import COOKIE, Session, Sessions, clear_cookie, same, set_cookie, since_key
from run_engine.dependencies import DEPENDENCY_ERRORS, MAYBE_REFUSING, refusing_writes
from run_engine.engine import Environment, RunEngine
from run_engine.errors import RunEngineError
from run_engine.statuses import FINAL_RUN_STATUSES, RunStatus
from run_engine.tenancy import hash_secret

HERE = Path(__file__).parent
FLASH_COOKIE = "re_flash"
#: a form is small: the largest is a test run's payload, bounded by the payload limit
FORM_OVERHEAD_BYTES = 64 * 1024
#: the sign-in form, which anyone may post: a key, its token and where to go next (a page's filters)
SIGN_IN_FORM_BYTES = FORM_OVERHEAD_BYTES
#: what every dashboard answer carries: no framing (clickjacking), no inline script, no referrer
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@dataclass(frozen=True, slots=True)
class Dash:
    """A signed-in request: the API context, the environment and the session."""

    ctx: ApiContext
    env: Environment
    session: Session

    @property
    def auth(self) -> EnvAuth:
        return EnvAuth.of(self.env)


def _ago(value: datetime | str | None) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    seconds = (datetime.now(UTC) - value).total_seconds()
    future = seconds < 0
    seconds = abs(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            text = f"{int(seconds // size)}{unit}"
            break
    else:
        text = f"{int(seconds)}s"
    return f"in {text}" if future else f"{text} ago"


def _when(value: datetime | str | None) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def _pretty(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS, default=str).decode()


def _status_class(status: str) -> str:
    try:
        s = RunStatus(status)
    except ValueError:
        return "other"
    if s == RunStatus.COMPLETED:
        return "ok"
    if s in FINAL_RUN_STATUSES:
        return "bad" if s != RunStatus.CANCELED else "muted"
    return {RunStatus.EXECUTING: "busy", RunStatus.DEQUEUED: "busy", RunStatus.WAITING: "wait"}.get(s, "queued")


TEMPLATES = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                               trim_blocks=True, lstrip_blocks=True)
TEMPLATES.filters.update(ago=_ago, when=_when, pretty=_pretty, status_class=_status_class)
TEMPLATES.globals["NAV"] = (("runs", "Runs"), ("queues", "Queues"), ("dlq", "Dead letters"), ("batches", "Batches"),
                            ("tokens", "Tokens"), ("schedules", "Schedules"), ("workers", "Workers"))


def sessions(ctx: ApiContext) -> Sessions:
    return Sessions(ctx.tokens.derive("dashboard-session"))


def render(request: Request, template: str, context: dict[str, Any], *, dash: Dash | None = None,
           status: int = 200, flash: str | None = None) -> Response:
    flash = flash if flash is not None else unquote(request.cookies.get(FLASH_COOKIE) or "")
    html = TEMPLATES.get_template(template).render(
        request=request, dash=dash, env=dash.env if dash else None, csrf=dash.session.csrf if dash else "",
        flash=flash, **context)
    response = HTMLResponse(html, status, headers=SECURITY_HEADERS)
    if request.cookies.get(FLASH_COOKIE):
        clear_cookie(response, request, FLASH_COOKIE)
    return response


def redirect(request: Request, to: str, flash: str | None = None) -> Response:
    """303 to a dashboard path (only: never an open redirect), with a one-time message."""
    if not to.startswith("/dashboard") or to.startswith("//"):
        to = "/dashboard/runs"
    response = RedirectResponse(to, 303, headers=SECURITY_HEADERS)
    if flash:
        set_cookie(response, request, FLASH_COOKIE, quote(flash[:300]), 60)
    return response


async def signed_in(request: Request) -> Dash | None:
    """The session's environment, if the cookie is ours, unexpired, not signed out, and its key
    still the one. Whether it was signed out is asked of Redis on every call (one round trip, never
    cached): Redis unreachable, this raises (the caller answers 503: fail closed); a session opened
    before Redis's signed-out marks begin (it lost them) is refused too."""
    ctx = ctx_of(request)
    session = sessions(ctx).read(request.cookies.get(COOKIE), ctx.engine.now())
    if session is None:
        return None
    env = await ctx.environment(session.env_id)
    if env is None or not same(session.key_hash_prefix, env.api_key_hash[:16]):
        return None
    prefix = ctx.engine.settings.key_prefix
    async with ctx.engine.redis.pipeline(transaction=False) as pipe:
        pipe.exists(session.signed_out_key(prefix))
        pipe.get(since_key(prefix))
        signed_out, since = await pipe.execute()
    if signed_out:
        return None
    if not session.known_since(int(since) if since is not None else await marks_since(ctx.engine)):
        return None
    return Dash(ctx, env, session)


async def marks_since(engine: RunEngine) -> int:
    """The time from which Redis holds every session's signed-out mark: written now when missing
    (a new installation, or Redis lost its data), the value a concurrent writer won with otherwise."""
    now, key = int(engine.now()), since_key(engine.settings.key_prefix)
    if await engine.redis.set(key, now, nx=True):
        return now
    earlier = await engine.redis.get(key)
    return now if earlier is None else int(earlier)


async def sign_out(dash: Dash) -> None:
    """Mark the session signed out in Redis until it would have expired (every copy of its cookie
    ends with it); raises when Redis cannot be reached."""
    engine = dash.ctx.engine
    await engine.redis.set(dash.session.signed_out_key(engine.settings.key_prefix), "1",
                           ex=dash.session.signed_out_ttl_s(engine.now()))


def key_hash(key: str) -> str:
    return hash_secret(key)


#: what a page shows as an error page instead of the API's JSON answer (of MAYBE_REFUSING, a
#: dependency refusing writes for a while: the others are the engine's own errors, 500s)
EXPECTED = (ApiError, RunEngineError, *DEPENDENCY_ERRORS, *MAYBE_REFUSING)


def _error_page(request: Request, dash: Dash | None, exc: Exception) -> Response:
    """The error page of ``exc``; without ``dash`` (the session could not be checked) it shows
    nothing of the environment."""
    if isinstance(exc, MAYBE_REFUSING) and refusing_writes(exc) is None:
        raise exc
    status, data, headers = error_payload(exc)
    response = render(request, "error.html", {"status": status, "message": data["error"]["message"],
                                              "title": "Error"}, dash=dash, status=status)
    response.headers.update(headers or {})
    return response


Handler = Callable[[Request, Dash], Awaitable[Response]]


def page(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """A page for signed-in users: others are sent to the sign-in form; an API error is a page."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            dash = await signed_in(request)
        except EXPECTED as exc:  # PostgreSQL or Redis away: the session cannot be checked
            return _error_page(request, None, exc)
        if dash is None:
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            return RedirectResponse(f"/dashboard/login?next={quote(target, safe='')}", 303, headers=SECURITY_HEADERS)
        try:
            await dash.ctx.check_limit(dash.auth.bucket)
            return await handler(request, dash)
        except EXPECTED as exc:
            return _error_page(request, dash, exc)

    return wrapped


def action(handler: Callable[[Request, Dash, dict[str, str]], Awaitable[Response]],
           ) -> Callable[[Request], Awaitable[Response]]:
    """A form post of a signed-in user carrying the session's CSRF token; answered with a redirect
    (or, for a bad input, the error page)."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            dash = await signed_in(request)
        except EXPECTED as exc:
            return _error_page(request, None, exc)
        if dash is None:
            return RedirectResponse("/dashboard/login", 303, headers=SECURITY_HEADERS)
        try:
            await dash.ctx.check_limit(dash.auth.bucket)
            form = await read_form(request, dash.ctx)
            token = form.get("csrf") or request.headers.get("x-csrf-token", "")
            if not same(token, dash.session.csrf):
                raise ApiError(403, "forbidden", "this form has expired or did not come from this dashboard: "
                                                 "reload the page and try again")
            return await handler(request, dash, form)
        except EXPECTED as exc:
            return _error_page(request, dash, exc)

    return wrapped


async def read_form(request: Request, ctx: ApiContext, limit: int | None = None) -> dict[str, str]:
    """An ``application/x-www-form-urlencoded`` body of at most ``limit`` bytes (by default the
    largest a signed-in form may be: a payload, percent-encoded); one value per field."""
    raw = await read_body(request, ctx.engine.settings.max_payload_bytes * 3 + FORM_OVERHEAD_BYTES
                          if limit is None else limit)
    # a large form (a payload of megabytes, percent-escaped: a second or two of unquoting) is parsed
    # off the event loop: the loop's other requests, every tenant's, go on meanwhile
    return await asyncio.to_thread(_parse_form, raw) if len(raw) > SCAN_OFF_LOOP_BYTES else _parse_form(raw)


def _parse_form(raw: bytes | bytearray) -> dict[str, str]:
    try:
        text = raw.decode("utf-8")
        fields = parse_qs(text, keep_blank_values=True, max_num_fields=50, errors="strict")
    except (UnicodeDecodeError, ValueError):
        raise ApiError(400, "invalid_input", "the form is not valid UTF-8 form data") from None
    if any("\x00" in k or any("\x00" in v for v in vs) for k, vs in fields.items()):
        raise ApiError(400, "invalid_input", "the form holds a NUL character")
    return {k: vs[-1] for k, vs in fields.items()}
