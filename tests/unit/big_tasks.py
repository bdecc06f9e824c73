"""Tasks for tests/unit/test_executor_pipe.py: messages of several megabytes both ways, and where
the task module was imported."""

from __future__ import annotations

import os
from typing import Any

from run_engine.sdk import task


@task(id="big-output")
async def big_output(payload: dict[str, Any], ctx: Any) -> str:
    return "o" * payload["size"]


@task(id="big-step")
async def big_step(payload: dict[str, Any], ctx: Any) -> int:
    """A journaled step whose result travels to the supervisor (or is replayed from the journal)."""
    result = await ctx.step("big", lambda: "s" * payload["size"])
    return len(result)


@task(id="many-items")
async def many_items(payload: dict[str, Any], ctx: Any) -> int:
    items = [{"n": i, "pad": "p" * 2000} for i in range(payload["count"])]
    result = await ctx.step("items", lambda: items)
    return len(result)


IMPORTED_IN = os.getpid()  # the process that imported this module


@task(id="where")
async def where(payload: Any, ctx: Any) -> dict[str, int]:
    return {"imported_in": IMPORTED_IN, "runs_in": os.getpid()}
