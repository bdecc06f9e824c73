"""Tasks the end-to-end tests run on real supervisors."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

from run_engine.sdk import AbortTaskRunError, queue, task

one_at_a_time = queue("e2e-limited", concurrency_limit=2)


@task(id="echo")
async def echo(payload, ctx):
    return {"payload": payload, "attempt": ctx.attempt.number, "run": ctx.run.id, "task": ctx.task.id}


@task(id="sync-echo")
def sync_echo(payload):
    return {"sync": payload}


@task(id="always-fails", retry={"max_attempts": 2, "min_timeout": 0.2, "factor": 1, "randomize": False})
def always_fails(payload, ctx):
    raise ValueError(f"nope {ctx.attempt.number}")


@task(id="aborts", retry={"max_attempts": 5, "min_timeout": 0.1})
def aborts(payload):
    raise AbortTaskRunError("stop right there")


@task(id="not-json")
def not_json(payload):
    return {"when": object()}


@task(id="sleeper", max_duration=2)
def sleeper(payload):
    time.sleep(float(payload.get("seconds", 30)))
    return "woke"


@task(id="crash-once", retry={"max_attempts": 3, "min_timeout": 0.2, "randomize": False})
def crash_once(payload, ctx):
    if ctx.attempt.number == 1:
        os._exit(3)  # the executor process dies
    return {"attempt": ctx.attempt.number, "pid": os.getpid()}


@task(id="hog", machine="micro", retry={"max_attempts": 1})
def hog(payload):
    blocks = [bytearray(64 * 1024 * 1024) for _ in range(8)]  # 512 MiB > micro's 256 MiB
    time.sleep(2)
    return len(blocks)


@task(id="long", retry={"max_attempts": 3, "min_timeout": 0.2, "randomize": False})
async def long(payload, ctx):
    await asyncio.sleep(float(payload.get("seconds", 3)))
    return {"attempt": ctx.attempt.number, "pid": os.getpid()}


@task(id="limited", queue=one_at_a_time)
async def limited(payload, ctx):
    log = Path(payload["log"])

    def note(event: str) -> None:
        with log.open("a") as f:
            f.write(json.dumps({"run": ctx.run.id, "event": event, "t": time.time()}) + "\n")

    note("start")
    await asyncio.sleep(0.3)
    note("end")
    return "ok"


@task(id="spawns-child")
async def spawns_child(payload, ctx):
    child = await echo.trigger({"from": ctx.run.id})  # with this run's token: a child run
    return {"child": child.id}


@task(id="record")
def record(payload, ctx):
    with Path(payload["log"]).open("a") as f:
        f.write(f"{ctx.run.id} {os.getpid()}\n")
    return None
