"""Runs from outside a task: retrieve, list, cancel, replay."""

from __future__ import annotations

from typing import Any

from run_engine.sdk.client import expect, request


async def retrieve(run_id: str) -> dict[str, Any]:
    return expect(await request("GET", f"/api/v3/runs/{run_id}"), "id", "status", what=f"run {run_id}")


async def list(**filters: str) -> dict[str, Any]:  # noqa: A001 - the SDK's documented name
    """``filters`` map to ``filter[...]`` query parameters, e.g. ``status="COMPLETED"``."""
    params = {f"filter[{k}]": v for k, v in filters.items() if k not in {"size", "after"}}
    if "size" in filters:
        params["page[size]"] = filters["size"]
    if "after" in filters:
        params["page[after]"] = filters["after"]
    return expect(await request("GET", "/api/v1/runs", params=params), "data", what="runs.list")


async def cancel(run_id: str) -> dict[str, Any]:
    """Cancel the run (a no-op on a finished one: tried again after a lost answer)."""
    return expect(await request("POST", f"/api/v2/runs/{run_id}/cancel", idempotent=True), "id",
                  what=f"cancel {run_id}")


async def replay(run_id: str) -> dict[str, Any]:
    """A new run like ``run_id``. Each call makes one, so one whose answer was lost is not tried
    again: it raises ``TaskError`` with code ``outcome_unknown`` (look at the runs before replaying again)."""
    return expect(await request("POST", f"/api/v1/runs/{run_id}/replay"), "id", what=f"replay {run_id}")
