"""The public API from Python (httpx). Outside a task it uses ``RUN_ENGINE_API_URL`` and
``RUN_ENGINE_API_KEY``; inside a task, the run's own token (``RUN_ENGINE_RUN_TOKEN``), so child
runs are triggered as that run's children.

A call is tried again, at most ``TRIES`` times in all, only where that cannot do twice what it does
once: a request that never reached the server (no connection), one the server refused before doing
anything (429, after its ``Retry-After``), and, for a call that is the same done twice (a read, a
cancel, a token's completion, a trigger or batch carrying its idempotency key), a lost answer or a
5xx/408. Anything else, and the last failure, raises :class:`~run_engine.sdk.errors.TaskError`."""

from __future__ import annotations

import asyncio
import email.utils
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from run_engine.sdk.errors import TaskError

TRIES = 4
BACKOFF_S = 0.5  # then 1 s, 2 s
MAX_RETRY_AFTER_S = 60.0  # a server asking for a longer pause is answered with its error at once
RETRYABLE = frozenset({408, 429, 500, 502, 503, 504})
_pause = asyncio.sleep  # between tries (tests note the pauses instead)
UNSENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)  # the server saw nothing


def _config() -> tuple[str, str]:
    url = os.environ.get("RUN_ENGINE_API_URL", "http://127.0.0.1:3030")
    key = os.environ.get("RUN_ENGINE_RUN_TOKEN") or os.environ.get("RUN_ENGINE_API_KEY")
    if not key:
        raise TaskError(401, "unauthorized", "set RUN_ENGINE_API_KEY (an environment secret key)")
    return url.rstrip("/"), key


@dataclass(frozen=True, slots=True)
class Answer:
    data: Any
    resent: bool  # sent again after a try whose outcome is unknown (its answer lost, a 5xx): it may have been done


def retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        when = email.utils.parsedate_to_datetime(value) if value.strip() else None
        return None if when is None else max(0.0, when.timestamp() - time.time())


def _decode(response: httpx.Response, method: str, path: str) -> Any:
    """The answer's JSON, or a TaskError saying the answer is not run-engine's (a proxy's page,
    a body cut short)."""
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        raise TaskError(response.status_code, "bad_response",
                        f"{method} {path}: not a run-engine answer "
                        f"({response.headers.get('content-type', 'no content type')}): {response.text[:200]!r}",
                        ) from None


async def send(method: str, path: str, json: Any = None, params: dict[str, str] | None = None,
               timeout: float = 30, *, headers: dict[str, str] | None = None,  # noqa: ASYNC109 - per request
               idempotent: bool | None = None, tries: int = TRIES) -> Answer:
    """:func:`request`, also saying whether it was sent again after a lost answer."""
    url, key = _config()
    safe = method in ("GET", "HEAD") if idempotent is None else idempotent
    resent = False
    async with httpx.AsyncClient(base_url=url, timeout=timeout,
                                 headers={"Authorization": f"Bearer {key}", **(headers or {})}) as client:
        for attempt in range(1, tries + 1):
            last = attempt == tries
            pause = BACKOFF_S * 2 ** (attempt - 1)
            try:
                response = await client.request(method, path, json=json, params=params)
            except UNSENT as exc:
                if last:
                    raise TaskError(0, "unreachable", f"{method} {path}: cannot reach {url} "
                                    f"({type(exc).__name__}: {exc}) after {tries} tries") from None
            except httpx.TransportError as exc:
                if not safe:
                    raise TaskError(0, "outcome_unknown",
                                    f"{method} {path}: the answer was lost ({type(exc).__name__}: {exc}); "
                                    "the server may have done it: look before doing it again") from None
                if last:
                    raise TaskError(0, "unreachable", f"{method} {path}: no answer from {url} "
                                    f"({type(exc).__name__}: {exc}) after {tries} tries") from None
                resent = True
            else:
                status = response.status_code
                if status < 400:
                    return Answer(_decode(response, method, path), resent)
                wait = retry_after(response)
                again = not last and (status == 429 or (safe and status in RETRYABLE)) \
                    and (wait is None or wait <= MAX_RETRY_AFTER_S)
                if not again:
                    data = _decode(response, method, path)
                    err = data.get("error") if isinstance(data, dict) else None
                    err = err if isinstance(err, dict) else {}
                    raise TaskError(status, str(err.get("code") or "error"),
                                    str(err.get("message") or response.text[:200]))
                if wait is not None:
                    pause = wait
                resent = resent or status != 429  # a 429 did nothing; a 5xx may have
            await _pause(pause)
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises


async def request(method: str, path: str, json: Any = None, params: dict[str, str] | None = None,
                  timeout: float = 30, *, headers: dict[str, str] | None = None,  # noqa: ASYNC109 - per request
                  idempotent: bool | None = None, tries: int = TRIES) -> Any:
    """One call of the API: its JSON answer. ``idempotent`` (default: GET and HEAD are) says that
    sending it twice does what sending it once does, so that a lost answer or a 5xx is tried
    again; ``timeout`` bounds each try."""
    return (await send(method, path, json, params, timeout, headers=headers, idempotent=idempotent,
                       tries=tries)).data


def expect(data: Any, *fields: str, what: str) -> dict[str, Any]:
    """``data`` as the object an answer should be, with ``fields``: a TaskError otherwise."""
    if not isinstance(data, dict) or any(f not in data for f in fields):
        raise TaskError(200, "bad_response", f"{what}: not a run-engine answer: {str(data)[:200]!r}")
    return data


def sdk_key() -> str:
    """An idempotency key of one call of the SDK: its tries all carry it, and nothing else does."""
    return f"sdk:{uuid.uuid4().hex}"


#: how long a call's own key is kept (OWN_KEY_TTL, with the call's idempotencyKeyTTL): long enough
#: for its tries (4 at most, 30 s each), and no longer. Retention keeps a run, or a token, for as
#: long as its key holds: with the server's default (30 days) every run the SDK triggered outside a
#: task was kept a month, whatever the installation's retention
OWN_KEY_TTL = "1h"
