"""The tasks of ``bench/chaos.py``. Each writes a ledger (``CHAOS_LEDGER``, one JSON line per
event, appended with one ``write``) that the run's checks read back: when an attempt began, when a
journaled step's body ran (with a token it returns, so the journaled result names the execution
that produced it) and when an attempt returned.

Retries are generous: the faults kill executors and supervisors mid-run, and a run must still end
with its task's own result, not with its attempts used up by the infrastructure."""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import time
from typing import Any

import orjson

from run_engine.sdk import task, wait

RETRY = {"max_attempts": 12, "min_timeout": 0.2, "max_timeout": 2, "factor": 1.5, "randomize": True}


def note(event: str, run_id: str, **fields: Any) -> str:
    """Append one line to the ledger; returns a token naming this execution."""
    token = secrets.token_hex(6)
    line = orjson.dumps({"e": event, "run": run_id, "t": time.time(), "tok": token, **fields}) + b"\n"
    fd = os.open(os.environ["CHAOS_LEDGER"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return token


async def work(ctx: Any, payload: dict[str, Any]) -> None:
    note("begin", ctx.run.id, attempt=ctx.attempt.number)
    await asyncio.sleep(payload.get("sleep", random.uniform(0, 0.3)))


def step_body(run_id: str, key: str) -> str:
    return note("step", run_id, key=key)


@task(id="chaos-plain", retry=RETRY)
async def plain(payload: dict[str, Any], ctx: Any) -> int:
    await work(ctx, payload)
    note("end", ctx.run.id, attempt=ctx.attempt.number)
    return int(payload["n"]) * 2


@task(id="chaos-flaky", retry=RETRY)
async def flaky(payload: dict[str, Any], ctx: Any) -> int:
    """Fails its first ``fail`` attempts on purpose, then succeeds."""
    await work(ctx, payload)
    if ctx.attempt.number <= payload.get("fail", 1):
        raise RuntimeError(f"failing attempt {ctx.attempt.number} on purpose")
    note("end", ctx.run.id, attempt=ctx.attempt.number)
    return int(payload["n"]) * 2


@task(id="chaos-steps", retry=RETRY)
async def steps(payload: dict[str, Any], ctx: Any) -> list[str]:
    """Two journaled steps around a wait (the run is suspended and restored by replay between)."""
    await work(ctx, payload)
    a = await ctx.step("a", step_body, ctx.run.id, "a")
    await wait.for_(seconds=payload.get("wait", 1.0))
    b = await ctx.step("b", step_body, ctx.run.id, "b")
    note("end", ctx.run.id, attempt=ctx.attempt.number)
    return [a, b]


@task(id="chaos-token", retry=RETRY)
async def token_waiter(payload: dict[str, Any], ctx: Any) -> Any:
    """Waits on a token that the load generator completes from outside."""
    await work(ctx, payload)
    result = await wait.for_token(payload["token"])
    note("end", ctx.run.id, attempt=ctx.attempt.number)
    return result.output


@task(id="chaos-parent", retry=RETRY)
async def parent(payload: dict[str, Any], ctx: Any) -> int:
    await work(ctx, payload)
    result = await plain.trigger_and_wait({"n": payload["n"]})
    note("end", ctx.run.id, attempt=ctx.attempt.number)
    return int(result.output) + 1 if result.ok else -1


@task(id="chaos-fanout", retry=RETRY)
async def fanout(payload: dict[str, Any], ctx: Any) -> int:
    await work(ctx, payload)
    results = await plain.batch_trigger_and_wait([{"n": payload["n"] + i} for i in range(3)])
    note("end", ctx.run.id, attempt=ctx.attempt.number)
    return sum(int(r.output) for r in results) if all(r.ok for r in results) else -1


@task(id="chaos-slow", retry=RETRY)
async def slow(payload: dict[str, Any], ctx: Any) -> int:
    """Long enough to be cancelled while it executes."""
    await work(ctx, {"sleep": payload.get("sleep", 2.0)})
    note("end", ctx.run.id, attempt=ctx.attempt.number)
    return int(payload["n"]) * 2
