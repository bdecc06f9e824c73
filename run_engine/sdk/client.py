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


async def request(method: str, path: str, json: Any = None, params: dict[str, str] | None = None,
                  timeout: float = 30) -> Any:  # noqa: ASYNC109 - httpx's own timeout, per request
    url, key = _config()
    async with httpx.AsyncClient(base_url=url, timeout=timeout, headers={"Authorization": f"Bearer {key}"}) as client:
        response = await client.request(method, path, json=json, params=params)
    data = response.json() if response.content else None
    if response.status_code >= 400:
        err = (data or {}).get("error", {}) if isinstance(data, dict) else {}
        raise TaskError(response.status_code, err.get("code", "error"), err.get("message", response.text))
    return data
