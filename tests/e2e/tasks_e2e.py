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


@task(id="sized-output", retry={"max_attempts": 3, "min_timeout": 0.2})
def sized_output(payload):
    return "o" * int(payload["bytes"])


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


@task(id="hog-then-larger", machine="micro",
      retry={"max_attempts": 2, "min_timeout": 0.1, "randomize": False, "out_of_memory": {"machine": "small-2x"}})
def hog_then_larger(payload, ctx):
    blocks = [bytearray(64 * 1024 * 1024) for _ in range(6)]  # 384 MiB: over micro's 256, under small-2x's 1024
    time.sleep(1)
    return {"attempt": ctx.attempt.number, "mib": 64 * len(blocks)}


@task(id="long", retry={"max_attempts": 3, "min_timeout": 0.2, "randomize": False})
async def long(payload, ctx):
    if payload.get("started"):  # a file the test waits for: the task runs in its executor
        await asyncio.to_thread(Path(payload["started"]).write_text, ctx.run.id)
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


# --- waits (issue 4) ----------------------------------------------------------------------------

from datetime import datetime  # noqa: E402

from run_engine.sdk import tokens, wait  # noqa: E402


def _note(path: str, line: str) -> str:
    with Path(path).open("a") as f:
        f.write(line + "\n")
    return line


@task(id="waits-for-token")
async def waits_for_token(payload, ctx):
    result = await wait.for_token(payload["token"])
    return {"ok": result.ok, "output": result.output, "error": result.error}


@task(id="waits-for-run")
async def waits_for_run(payload, ctx):
    result = await wait.for_run(payload["run"])
    return {"ok": result.ok, "output": result.output, "error": result.error}


@task(id="waits-up")
async def waits_up(payload, ctx):
    """A chain of ``depth`` runs below this one, each triggering and waiting for the next; the last
    waits (wait.for_run) on the run ``up`` levels above it (0: itself). Each passes its answer up."""
    above = [*payload.get("above", []), ctx.run.id]
    if len(above) <= payload["depth"]:
        return (await waits_up.trigger_and_wait({**payload, "above": above})).output
    result = await wait.for_run(above[-1 - payload["up"]])
    return {"ok": result.ok, "error": result.error, "target": above[-1 - payload["up"]],
            "attempt": ctx.attempt.number}


@task(id="creates-token-and-waits")
async def creates_token_and_waits(payload, ctx):
    token = await tokens.create(timeout=payload.get("timeout"), tags=[ctx.run.id],
                                idempotency_key=payload.get("key"))
    result = await wait.for_token(token)
    return {"token": token.id, "ok": result.ok, "output": result.output, "error": result.error}


@task(id="short-wait")
async def short_wait(payload, ctx):
    _note(payload["log"], "start")
    await wait.for_(seconds=0.05)
    return "done"


@task(id="waits-until")
async def waits_until(payload, ctx):
    await wait.until(datetime.fromisoformat(payload["at"]))
    return time.time()


@task(id="steps-through-waits")
async def steps_through_waits(payload, ctx):
    log = payload["log"]
    _note(log, "start")  # not journaled: runs again on every restore
    a = await ctx.step("a", _note, log, "step a")
    await wait.for_(seconds=payload.get("seconds", 1.5))
    b = await ctx.step("b", _note, log, "step b")
    token = await tokens.create(tags=[ctx.run.id])
    approval = await wait.for_token(token)
    c = await ctx.step("c", _note, log, "step c")
    return {"steps": [a, b, c], "approval": approval.output}


@task(id="big-journal")
async def big_journal(payload, ctx):
    """Steps whose results take more than a page of the journal (16 MiB), then a wait on a token:
    restored, the replay reads the journal's later pages as it gets there."""
    log = payload["log"]
    sizes = []
    for i in range(payload["steps"]):
        result = await ctx.step(f"s{i}", lambda i=i: _note(log, f"step {i}") and f"{i}:" + "j" * payload["bytes"])
        sizes.append([result.split(":", 1)[0], len(result)])
    approval = await wait.for_token(payload["token"])
    return {"sizes": sizes, "approval": approval.output}


@task(id="maybe-fails", retry={"max_attempts": 1})
async def maybe_fails(payload):
    if payload % 3 == 0:
        raise ValueError(f"bad {payload}")
    return payload * 2


@task(id="waits-for-child")
async def waits_for_child(payload, ctx):
    result = await maybe_fails.trigger_and_wait(payload["n"])
    return {"ok": result.ok, "id": result.id, "output": result.output, "error": result.error}


@task(id="fans-out")
async def fans_out(payload, ctx):
    results = await maybe_fails.batch_trigger_and_wait(list(range(payload["n"])))
    return [{"ok": r.ok, "id": r.id, "output": r.output, "error": (r.error or {}).get("message")} for r in results]


@task(id="fans-out-big")
async def fans_out_big(payload, ctx):
    """Megabytes both ways over the executor's pipe: 1,000 items of 2 KB out, their outputs back."""
    results = await echo.batch_trigger_and_wait([{"i": i, "pad": "p" * 2000} for i in range(payload["n"])])
    return {"count": len(results), "ok": all(r.ok for r in results),
            "sum": sum(r.output["payload"]["i"] for r in results if r.ok)}


@task(id="waits-for-long-child")
async def waits_for_long_child(payload, ctx):
    await long.trigger_and_wait({"seconds": 60})
    return "should never get here"


single_file = queue("e2e-single", concurrency_limit=1)


@task(id="waits-in-single-queue", queue=single_file)
async def waits_in_single_queue(payload, ctx):
    _note(payload["log"], f"start {payload['name']} {time.time()}")
    if payload.get("token"):
        await wait.for_token(payload["token"])
    _note(payload["log"], f"end {payload['name']} {time.time()}")
    return payload["name"]


rated = queue("e2e-rated", rate_limit={"limit": 10, "period": "1s"})


@task(id="rated", queue=rated)
def rated_task(payload, ctx):
    _note(payload["log"], f"{time.time()}")
    return None


@task(id="waits-for-debounced")
async def waits_for_debounced(payload, ctx):
    """docs/API.md's way to wait on a debounced run: trigger it in a step, then wait.for_run."""
    async def debounced() -> str:
        options = {"debounce": {"key": payload["key"], "delay": "2s", "mode": "trailing"}}
        return (await echo.trigger({"from": ctx.run.id}, options)).id

    result = await wait.for_run(await ctx.step("debounced", debounced))
    return {"ok": result.ok, "output": result.output}


# --- metadata -------------------------------------------------------------------------------------

from run_engine.sdk import metadata  # noqa: E402


@task(id="metadata-through-waits")
async def metadata_through_waits(payload, ctx):
    """Sets, increments and appends its metadata around a wait long enough to suspend it: restored,
    the task runs from the start, and what it changed before the wait is not made again."""
    _note(payload["log"], json.dumps(metadata.current(), sort_keys=True))  # at each start
    metadata.set("status", "started")
    metadata.increment("count")
    metadata.append("events", "before wait")
    if payload.get("child"):
        metadata.parent.increment("children")
        metadata.parent.append("childRuns", ctx.run.id)
    await wait.for_(seconds=payload.get("seconds", 1.5))
    metadata.increment("count", by=2)
    metadata.append("events", "after wait")
    metadata.set("status", "done")
    return metadata.current()


@task(id="metadata-parent")
async def metadata_parent(payload, ctx):
    metadata.set("children", 0)
    child = await metadata_through_waits.trigger_and_wait({**payload, "child": True},
                                                          {"metadata": {"origin": "parent"}})
    return {"child": child.output, "current": metadata.current()}


# --- fire-and-forget triggers inside a task, across a restore ------------------------------------

async def _trigger_in_step(parent: str) -> str:
    return (await echo.trigger({"n": "in step"}, {"tags": [parent]})).id


@task(id="triggers-then-waits", retry={"max_attempts": 2, "min_timeout": 0.2, "factor": 1, "randomize": False})
async def triggers_then_waits(payload, ctx):
    """Triggers children without waiting for them (a run, one in a step, a batch of two, another
    run), notes what it got, then waits on a token long enough to be suspended: restored, the task
    runs from its start again. ``fail_first``: the first attempt fails after its wait."""
    tags = {"tags": [ctx.run.id]}
    child = await echo.trigger({"n": 1}, tags)
    in_step = await ctx.step("in-step", _trigger_in_step, ctx.run.id)
    batch = await echo.batch_trigger([{"n": 2}, {"n": 3}], tags)
    after = await echo.trigger({"n": 4}, tags)
    seen = {"attempt": ctx.attempt.number, "runs": [child.id, in_step, *(h.id for h in batch), after.id],
            "cached": [child.is_cached, *(h.is_cached for h in batch), after.is_cached]}
    _note(payload["log"], json.dumps(seen))
    await wait.for_token(payload["token"])
    if payload.get("fail_first") and ctx.attempt.number == 1:
        raise RuntimeError("fails once, after its wait")
    return seen
