"""Example tasks: `run-engine dev` runs these on its supervisor.

    curl -X POST $RUN_ENGINE_API_URL/api/v1/tasks/hello-world/trigger \
         -H "Authorization: Bearer $RUN_ENGINE_API_KEY" -d '{"payload": {"name": "Ada"}}'
"""

from __future__ import annotations

import asyncio
import os
import random
import time

from run_engine.sdk import AbortTaskRunError, queue, task

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
