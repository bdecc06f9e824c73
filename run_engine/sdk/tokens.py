"""``tokens``: waitpoint tokens an outside system completes (by API or callback URL).

Inside a task, ``tokens.create`` is journaled: a replay gets the same token back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from run_engine.sdk import runtime
from run_engine.sdk.client import OWN_KEY_TTL, expect, request, sdk_key, send


@dataclass(frozen=True, slots=True)
class Token:
    id: str
    url: str
    is_cached: bool = False


async def _create(body: dict[str, Any]) -> dict[str, Any]:
    own = "idempotencyKey" not in body  # a key of the call's own: its retry finds the token it made
    answer = await send("POST", "/api/v1/waitpoints/tokens", idempotent=True,
                        json={"idempotencyKeyTTL": OWN_KEY_TTL, **body, "idempotencyKey": sdk_key()} if own else body)
    data = expect(answer.data, "id", "url", what="tokens.create")
    return {**data, "isCached": False} if own else data


async def create(*, timeout: float | str | None = None, idempotency_key: str | None = None,  # noqa: ASYNC109
                 idempotency_key_ttl: float | str | None = None, tags: list[str] | None = None) -> Token:
    """Create a token; ``timeout`` is seconds or a duration like ``"1h"``."""
    body: dict[str, Any] = {k: v for k, v in {"timeout": timeout, "idempotencyKey": idempotency_key,
                                               "idempotencyKeyTTL": idempotency_key_ttl, "tags": tags}.items()
                            if v is not None}
    rt = runtime.current()
    data = await (rt.step("tokens.create", _create, body) if rt is not None else _create(body))
    return Token(data["id"], data["url"], data.get("isCached", False))


async def complete(token_id: str, data: Any = None) -> None:
    """Complete the token (the first completion wins: tried again after a lost answer)."""
    await request("POST", f"/api/v1/waitpoints/tokens/{token_id}/complete", json={"data": data}, idempotent=True)


async def retrieve(token_id: str) -> dict[str, Any]:
    return expect(await request("GET", f"/api/v1/waitpoints/tokens/{token_id}"), "id", "status",
                  what=f"token {token_id}")
