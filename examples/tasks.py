"""Example tasks: `run-engine dev` runs these on its supervisor.

    curl -X POST $RUN_ENGINE_API_URL/api/v1/tasks/hello-world/trigger \
         -H "Authorization: Bearer $RUN_ENGINE_API_KEY" -d '{"payload": {"name": "Ada"}}'
"""

from __future__ import annotations

import asyncio
import os
import random
import time

from run_engine.sdk import AbortTaskRunError, queue, task, tokens, wait

reports = queue("reports", concurrency_limit=2)


@task(id="hello-world")
async def hello_world(payload: dict, ctx) -> dict:
    name = (payload or {}).get("name", "world")
    return {"message": f"Hello, {name}!", "run": ctx.run.id, "attempt": ctx.attempt.number}


@task(id="build-report", queue=reports, retry={"max_attempts": 3, "factor": 2, "min_timeout": 1, "max_timeout": 10})
async def build_report(payload: dict, ctx) -> dict:
    await asyncio.sleep(float((payload or {}).get("seconds", 1)))
    return {"rows": random.randint(1, 1000), "attempt": ctx.attempt.number}


@task(id="flaky", retry={"max_attempts": 3, "min_timeout": 0.5, "factor": 2, "randomize": False})
def flaky(payload: dict, ctx) -> dict:
    if ctx.attempt.number < int((payload or {}).get("succeed_on", 2)):
        raise RuntimeError(f"attempt {ctx.attempt.number} failed on purpose")
    return {"attempt": ctx.attempt.number}


@task(id="abort")
def abort(payload: dict) -> None:
    raise AbortTaskRunError((payload or {}).get("reason", "aborted"))


@task(id="slow", max_duration=600)
def slow(payload: dict) -> dict:
    time.sleep(float((payload or {}).get("seconds", 5)))
    return {"slept": payload.get("seconds", 5) if payload else 5, "pid": os.getpid()}


@task(id="approval")
async def approval(payload: dict, ctx) -> dict:
    """Waits for a person: complete the token it prints with `run-engine tokens complete ID --data '"yes"'`."""
    token = await tokens.create(timeout=(payload or {}).get("timeout", "1h"), tags=[ctx.run.id])
    print(f"run {ctx.run.id} waits for token {token.id} (or POST to {token.url})", flush=True)
    answer = await wait.for_token(token)
    greeting = await ctx.step("greet", lambda: f"approved: {answer.output}" if answer.ok else "timed out")
    return {"approved": answer.ok, "answer": answer.output, "greeting": greeting}


@task(id="fan-out")
async def fan_out(payload: dict, ctx) -> dict:
    """Runs `hello-world` for every name and waits for all of them."""
    names = (payload or {}).get("names", ["Ada", "Grace", "Edsger"])
    results = await hello_world.batch_trigger_and_wait([{"name": n} for n in names])
    return {"messages": [r.output["message"] if r.ok else r.error for r in results]}
