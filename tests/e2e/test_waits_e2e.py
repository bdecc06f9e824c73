"""Waits end to end (issue 4): real server and supervisors, HTTP only. The supervisors suspend a
blocked run after 0.5 s (RUN_ENGINE_SUSPEND_AFTER_S in the e2e stack)."""

from __future__ import annotations

import json
import signal
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from .conftest import Stack, stop

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


@pytest.fixture(scope="module")
def waiting(stack: Stack) -> Stack:
    own = stack.project("waits")
    own.start_supervisor("waiter", concurrency=6)
    return own


def create_token(s: Stack, **body: Any) -> dict[str, Any]:
    with s.client() as c:
        r = c.post("/api/v1/waitpoints/tokens", json=body)
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def get_token(s: Stack, token_id: str) -> dict[str, Any]:
    with s.client() as c:
        r = c.get(f"/api/v1/waitpoints/tokens/{token_id}")
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def complete_token(s: Stack, token_id: str, data: Any) -> None:
    with s.client() as c:
        r = c.post(f"/api/v1/waitpoints/tokens/{token_id}/complete", json={"data": data})
    assert r.status_code == 200 and r.json() == {"success": True}, r.text


def until_suspended(s: Stack, run_id: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while s.snapshot(run_id)["executionStatus"] != "SUSPENDED":
        assert time.monotonic() < deadline, f"run {run_id} not suspended: {s.snapshot(run_id)}"
        time.sleep(0.05)


def test_token_completed_by_api_resumes_a_suspended_run(waiting: Stack) -> None:
    token = create_token(waiting, timeout="1h", tags=["e2e"])
    assert token["url"].startswith(waiting.url) and not token["isCached"]
    run_id = waiting.trigger("waits-for-token", {"token": token["id"]})
    until_suspended(waiting, run_id)
    assert waiting.run(run_id)["status"] == "WAITING" and waiting.run(run_id)["isWaiting"]
    assert get_token(waiting, token["id"])["status"] == "WAITING"
    complete_token(waiting, token["id"], {"approved": True})
    complete_token(waiting, token["id"], {"approved": False})  # the first completion wins
    run = waiting.wait_for(run_id)
    assert run["status"] == "COMPLETED", run
    assert run["output"] == {"ok": True, "output": {"approved": True}, "error": None}
    assert run["attemptCount"] == 1  # restored, not retried
    t = get_token(waiting, token["id"])
    assert t["status"] == "COMPLETED" and t["output"] == {"approved": True} and t["completedAt"]


def test_token_completed_by_callback_url_without_an_api_key(waiting: Stack) -> None:
    token = create_token(waiting)
    run_id = waiting.trigger("waits-for-token", {"token": token["id"]})
    waiting.wait_for(run_id, lambda r: r["status"] == "WAITING")
    forged = token["url"].rsplit("/", 1)[0] + "/not-the-signature"
    assert httpx.post(forged, json={"x": 1}).status_code == 401
    r = httpx.post(token["url"], json={"from": "outside"})
    assert r.status_code == 200 and r.json() == {"success": True}
    run = waiting.wait_for(run_id)
    assert run["output"]["output"] == {"from": "outside"}


def test_token_timeout_gives_the_task_an_error_it_can_inspect(waiting: Stack) -> None:
    run_id = waiting.trigger("creates-token-and-waits", {"timeout": 1})
    run = waiting.wait_for(run_id)
    assert run["status"] == "COMPLETED", run
    assert run["output"]["ok"] is False and run["output"]["error"]["type"] == "WAITPOINT_TIMEOUT"
    assert get_token(waiting, run["output"]["token"])["status"] == "TIMED_OUT"
    with waiting.client() as c:
        listed = c.get("/api/v1/waitpoints/tokens", params={"filter[status]": "TIMED_OUT",
                                                            "filter[tags]": run_id}).json()["data"]
    assert [t["id"] for t in listed] == [run["output"]["token"]]


def test_idempotent_token_creation(waiting: Stack) -> None:
    a = create_token(waiting, idempotencyKey="approve-42", idempotencyKeyTTL="1h")
    b = create_token(waiting, idempotencyKey="approve-42", idempotencyKeyTTL="1h")
    assert a["id"] == b["id"] and not a["isCached"] and b["isCached"]
    assert get_token(waiting, a["id"])["idempotencyKey"] == "approve-42"
    with waiting.client() as c:
        bad = c.post("/api/v1/waitpoints/tokens", json={"timeout": "soon"})
    assert bad.status_code == 400 and "timeout" in bad.json()["error"]["message"]


def test_short_wait_continues_in_process_and_wait_until_a_date(waiting: Stack, tmp_path: Path) -> None:
    log = tmp_path / "short.log"
    run = waiting.wait_for(waiting.trigger("short-wait", {"log": str(log)}))
    assert run["status"] == "COMPLETED"
    assert log.read_text().splitlines() == ["start"]  # never suspended, so never restored
    at = datetime.now(UTC) + timedelta(seconds=2)
    until = waiting.wait_for(waiting.trigger("waits-until", {"at": at.isoformat()}))
    assert until["status"] == "COMPLETED" and until["output"] >= at.timestamp()


def test_steps_run_exactly_once_through_suspensions_and_replays(waiting: Stack, tmp_path: Path) -> None:
    log = tmp_path / "steps.log"
    run_id = waiting.trigger("steps-through-waits", {"log": str(log), "seconds": 1.5})
    # the task creates its token (journaled) after the timed wait; find it by its tag
    deadline = time.monotonic() + 30
    while True:
        with waiting.client() as c:
            tokens = c.get("/api/v1/waitpoints/tokens", params={"filter[tags]": run_id}).json()["data"]
        if tokens and waiting.snapshot(run_id)["executionStatus"] == "SUSPENDED":
            break
        assert time.monotonic() < deadline, "the run never suspended on its token"
        time.sleep(0.1)
    assert len(tokens) == 1
    complete_token(waiting, tokens[0]["id"], "yes")
    run = waiting.wait_for(run_id)
    assert run["status"] == "COMPLETED", run
    assert run["output"] == {"steps": ["step a", "step b", "step c"], "approval": "yes"}
    lines = log.read_text().splitlines()
    assert [line for line in lines if line.startswith("step")] == ["step a", "step b", "step c"]  # each once
    assert lines.count("start") == 3  # run from the top three times: first, after the timer, after the token
    assert run["attemptCount"] == 1


def test_a_journal_of_more_than_a_page_is_replayed_a_page_at_a_time(waiting: Stack, tmp_path: Path) -> None:
    """Ten steps of 2 MiB each, then a wait: restored, the run replays every step (none runs again),
    the journal reaching its executor a page of 16 MiB at a time."""
    log = tmp_path / "steps.log"
    token = create_token(waiting)
    run_id = waiting.trigger("big-journal", {"log": str(log), "steps": 10, "bytes": 2 * 1024 * 1024,
                                            "token": token["id"]})
    until_suspended(waiting, run_id, timeout=60)
    with waiting.worker() as w:
        first = w.get(f"/engine/v1/worker-actions/runs/{run_id}/journal").json()
        assert 0 < len(first["journal"]) < 11 and first["next"] == len(first["journal"]), \
            [len(first["journal"]), first.get("next")]
        rest = w.get(f"/engine/v1/worker-actions/runs/{run_id}/journal", params={"from": first["next"]}).json()
        assert [e["sequence"] for e in first["journal"] + rest["journal"]] == list(range(11)) and "next" not in rest
    complete_token(waiting, token["id"], "yes")
    run = waiting.wait_for(run_id, timeout=60)
    assert run["status"] == "COMPLETED", run
    assert run["output"] == {"sizes": [[str(i), len(f"{i}:") + 2 * 1024 * 1024] for i in range(10)],
                             "approval": "yes"}
    assert log.read_text().splitlines() == [f"step {i}" for i in range(10)]  # each once: replayed after
    assert run["attemptCount"] == 1


def test_trigger_and_wait_of_a_failing_child_does_not_raise(waiting: Stack) -> None:
    run = waiting.wait_for(waiting.trigger("waits-for-child", {"n": 3}))
    assert run["status"] == "COMPLETED", run
    out = run["output"]
    assert out["ok"] is False and out["error"]["message"] == "bad 3"
    child = waiting.run(out["id"])
    assert child["status"] == "FAILED" and child["triggerFunction"] == "triggerAndWait"
    assert child["relatedRuns"]["parent"] == run["id"] and child["depth"] == 1
    ok = waiting.wait_for(waiting.trigger("waits-for-child", {"n": 4}))
    assert ok["output"]["ok"] is True and ok["output"]["output"] == 8


def test_batch_trigger_and_wait_of_100_items_in_order(waiting: Stack) -> None:
    run = waiting.wait_for(waiting.trigger("fans-out", {"n": 100}), timeout=120)
    assert run["status"] == "COMPLETED", run
    results = run["output"]
    assert len(results) == 100
    for i, r in enumerate(results):
        if i % 3 == 0:
            assert r["ok"] is False and r["error"] == f"bad {i}", (i, r)
        else:
            assert r["ok"] is True and r["output"] == i * 2, (i, r)
    assert len({r["id"] for r in results}) == 100


def test_a_batch_of_a_thousand_2kb_items_crosses_the_executor_pipe(waiting: Stack) -> None:
    """Issue 11: the 2 MB call was torn on the supervisor's non-blocking pipe and the parent stayed
    EXECUTING for good; the 2 MB of results come back the same way."""
    run = waiting.wait_for(waiting.trigger("fans-out-big", {"n": 1000}), timeout=240)
    assert run["status"] == "COMPLETED", run
    assert run["output"] == {"count": 1000, "ok": True, "sum": sum(range(1000))}


def test_cancel_cascades_to_the_child_a_run_waits_on(waiting: Stack) -> None:
    parent_id = waiting.trigger("waits-for-long-child", {})
    until_suspended(waiting, parent_id)
    with waiting.client() as c:
        children = c.get("/api/v1/runs", params={"filter[taskIdentifier]": "long"}).json()["data"]
        child_id = next(r["id"] for r in children if r["status"] in ("QUEUED", "EXECUTING", "DEQUEUED"))
        assert c.post(f"/api/v2/runs/{parent_id}/cancel").status_code == 200
    assert waiting.wait_for(parent_id)["status"] == "CANCELED"
    assert waiting.wait_for(child_id, timeout=30)["status"] == "CANCELED"


def test_a_suspended_run_holds_no_slot_of_its_queue(waiting: Stack, tmp_path: Path) -> None:
    log = tmp_path / "single.log"
    token = create_token(waiting)
    a = waiting.trigger("waits-in-single-queue", {"log": str(log), "name": "A", "token": token["id"]})
    until_suspended(waiting, a)
    b = waiting.trigger("waits-in-single-queue", {"log": str(log), "name": "B"})
    assert waiting.wait_for(b, timeout=30)["status"] == "COMPLETED"
    assert waiting.run(a)["status"] == "WAITING"
    complete_token(waiting, token["id"], None)
    assert waiting.wait_for(a)["status"] == "COMPLETED"
    events = [line.split()[:2] for line in log.read_text().splitlines()]
    assert events.index(["end", "B"]) < events.index(["end", "A"])


def test_killing_the_supervisor_while_runs_are_suspended_loses_nothing(stack: Stack) -> None:
    own = stack.project("waits-kill")
    doomed = own.start_supervisor("doomed-waiter", concurrency=4)
    tokens = [create_token(own)["id"] for _ in range(6)]
    runs = [own.trigger("waits-for-token", {"token": t}) for t in tokens]
    for run_id in runs:
        until_suspended(own, run_id)
    stop(doomed, signal.SIGKILL)
    for i, t in enumerate(tokens):
        complete_token(own, t, i)
    own.start_supervisor("rescuer-waiter", concurrency=4)
    for i, run_id in enumerate(runs):
        run = own.wait_for(run_id)
        assert run["status"] == "COMPLETED" and run["output"]["output"] == i, run


def test_a_run_waits_for_any_run_of_its_environment(waiting: Stack, stack: Stack) -> None:
    # a run still going: the waiter resumes with its output when it finishes
    target = waiting.trigger("long", {"seconds": 1})
    waiter = waiting.trigger("waits-for-run", {"run": target})
    done = waiting.wait_for(waiter)
    assert done["status"] == "COMPLETED", done
    assert done["output"]["ok"] is True and done["output"]["output"]["attempt"] == 1
    # a run that finished already: at once, with the same answer
    again = waiting.wait_for(waiting.trigger("waits-for-run", {"run": target}))
    assert again["output"] == done["output"]
    # a failed run: not ok, with its error
    failed = waiting.trigger("aborts", {})
    waiting.wait_for(failed)
    out = waiting.wait_for(waiting.trigger("waits-for-run", {"run": failed}))["output"]
    assert out["ok"] is False and out["error"]["type"] == "ABORT"
    # another environment's run is not found: the wait fails, nothing is waited on
    theirs = stack.project("waits-for-run-other").trigger("echo", {})
    denied = waiting.wait_for(waiting.trigger("waits-for-run", {"run": theirs}))
    assert denied["status"] == "FAILED", denied


def test_a_run_that_waits_on_itself_or_a_run_it_descends_from_is_told_at_once(waiting: Stack) -> None:
    """``wait.for_run`` on the run itself, its parent or its grandparent: each would finish only
    after the wait (before: the run stayed WAITING for good, its ancestors with it). The task gets
    a WAIT_DEADLOCK error as the outcome of the wait, on its first attempt, and goes on."""
    roots = [waiting.trigger("waits-up", {"depth": up, "up": up}) for up in (0, 1, 2)]
    for root in roots:
        done = waiting.wait_for(root)
        assert done["status"] == "COMPLETED", done
        out = done["output"]
        assert out["ok"] is False and out["error"]["type"] == "WAIT_DEADLOCK" and out["attempt"] == 1, out
        assert out["target"] == root and root in out["error"]["message"]


def test_a_run_that_blocks_while_runs_queue_for_the_slots_is_suspended_at_once(stack: Stack) -> None:
    """One slot and a grace period of two minutes: the first run that blocks would hold the slot
    for that long, but the dequeue that handed it out said more runs were ready, so it suspends
    at once and the others get the slot (each wait_for below gives up long before the grace)."""
    own = stack.project("waits-backlog")
    own.start_supervisor("backlog-waiter", concurrency=1, env={"RUN_ENGINE_SUSPEND_AFTER_S": "120"})
    tokens = [create_token(own)["id"] for _ in range(2)]
    items = [*({"task": "waits-for-token", "payload": {"token": t}} for t in tokens), {"task": "echo", "payload": 3}]
    with own.client() as c:
        r = c.post("/api/v1/tasks/batch", json={"items": items})
    assert r.status_code == 200, r.text
    a, b, echo = [run["id"] for run in r.json()["runs"]]
    for run_id in (a, b):
        until_suspended(own, run_id)
    assert own.wait_for(echo, timeout=30)["status"] == "COMPLETED"
    # the last run of the backlog blocks with nothing queued behind it: it waits in its executor
    token = create_token(own)["id"]
    last = own.trigger("waits-for-token", {"token": token})
    own.wait_for(last, lambda run: run["status"] == "WAITING", timeout=30)
    for i, t in enumerate([*tokens, token]):
        complete_token(own, t, i)
    for i, run_id in enumerate((a, b)):
        run = own.wait_for(run_id, timeout=30)
        assert run["status"] == "COMPLETED" and run["output"]["output"] == i and run["attemptCount"] == 1, run
    assert own.wait_for(last, timeout=30)["output"]["output"] == 2
    with psycopg.connect(own.env["DATABASE_URL"]) as conn:
        history = {run_id: [row[0] for row in conn.execute(
            "SELECT engine_status FROM task_run_execution_snapshot WHERE run_id = %s ORDER BY seq", (run_id,))]
            for run_id in (a, b, last)}
    for run_id in (a, b):  # blocked, then suspended in the same call: both snapshots kept
        h = history[run_id]
        assert ("EXECUTING_WITH_WAITPOINTS", "SUSPENDED") in zip(h, h[1:], strict=False), h
    assert "SUSPENDED" not in history[last] and "EXECUTING_WITH_WAITPOINTS" in history[last], history[last]


def test_metadata_changes_through_a_suspension_count_once_and_reach_the_parent(waiting: Stack,
                                                                                tmp_path: Path) -> None:
    """A task sets, increments and appends its metadata before and after a wait that suspends it
    (run_engine/sdk/metadata.py): restored, it runs from the start again, and its increment before
    the wait counts once; its metadata.parent.* reach its parent's metadata (once too)."""
    log = tmp_path / "metadata.log"
    run_id = waiting.trigger("metadata-through-waits", {"log": str(log)}, metadata={"origin": "trigger"})
    run = waiting.wait_for(run_id)
    assert run["status"] == "COMPLETED", run
    expected = {"origin": "trigger", "status": "done", "count": 3, "events": ["before wait", "after wait"]}
    assert run["metadata"] == expected and run["output"] == expected
    starts = [json.loads(line) for line in log.read_text().splitlines()]
    # first the trigger's metadata; restored, the run's as the first execution left it
    assert starts == [{"origin": "trigger"},
                      {"origin": "trigger", "status": "started", "count": 1, "events": ["before wait"]}]
    assert run["attemptCount"] == 1

    log = tmp_path / "parent.log"
    parent_id = waiting.trigger("metadata-parent", {"log": str(log)})
    parent = waiting.wait_for(parent_id)
    assert parent["status"] == "COMPLETED", parent
    [child_id] = parent["relatedRuns"]["children"]
    assert parent["output"]["child"] == {"origin": "parent", "status": "done", "count": 3,
                                         "events": ["before wait", "after wait"]}
    # set to 0 before the child ran, incremented by it once (its replay sent nothing again)
    assert parent["metadata"] == {"children": 1, "childRuns": [child_id]}
    assert parent["output"]["current"] == parent["metadata"]  # the parent's copy, restored, is the server's
