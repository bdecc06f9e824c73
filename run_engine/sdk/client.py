"""The public API from Python (httpx). Outside a task it uses ``RUN_ENGINE_API_URL`` and
``RUN_ENGINE_API_KEY``; inside a task, the run's own token (``RUN_ENGINE_RUN_TOKEN``), so child
runs are triggered as that run's children."""

from __future__ import annotations

import os
from typing import Any

import httpx

from run_engine.sdk.errors import TaskError


def _config() -> tuple[str, str]:
    url = os.environ.get("RUN_ENGINE_API_URL", "http://127.0.0.1:3030")
    key = os.environ.get("RUN_ENGINE_RUN_TOKEN") or os.environ.get("RUN_ENGINE_API_KEY")
    if not key:
        raise TaskError(401, "unauthorized", "set RUN_ENGINE_API_KEY (an environment secret key)")
    return url.rstrip("/"), key


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


async def request(method: str, path: str, json: Any = None, params: dict[str, str] | None = None,
                  timeout: float = 30) -> Any:  # noqa: ASYNC109 - httpx's own timeout, per request
    url, key = _config()
    async with httpx.AsyncClient(base_url=url, timeout=timeout, headers={"Authorization": f"Bearer {key}"}) as client:
        response = await client.request(method, path, json=json, params=params)
    data = _decode(response, method, path)
    if response.status_code >= 400:
        err = data.get("error") if isinstance(data, dict) else None
        err = err if isinstance(err, dict) else {}
        raise TaskError(response.status_code, str(err.get("code") or "error"),
                        str(err.get("message") or response.text[:200]))
    return data


def expect(data: Any, *fields: str, what: str) -> dict[str, Any]:
    """``data`` as the object an answer should be, with ``fields``: a TaskError otherwise."""
    if not isinstance(data, dict) or any(f not in data for f in fields):
        raise TaskError(200, "bad_response", f"{what}: not a run-engine answer: {str(data)[:200]!r}")
    return data
