"""Runs end to end: real server and supervisors, HTTP only."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import pytest

from .conftest import Stack, stop

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


@pytest.fixture(scope="module")
def supervised(stack: Stack) -> Stack:
    stack.start_supervisor("main", concurrency=6)
    return stack


def test_trigger_to_completed_with_output(supervised: Stack) -> None:
    run_id = supervised.trigger("echo", {"hello": "world"})
    run = supervised.wait_for(run_id)
    assert run["status"] == "COMPLETED" and run["isSuccess"] and run["isCompleted"]
    assert run["output"] == {"payload": {"hello": "world"}, "attempt": 1, "run": run_id, "task": "echo"}
    assert run["attemptCount"] == 1 and run["startedAt"] and run["finishedAt"]
    sync = supervised.wait_for(supervised.trigger("sync-echo", [1, 2]))
    assert sync["output"] == {"sync": [1, 2]}


def test_failing_task_is_retried_then_failed_with_its_error(supervised: Stack) -> None:
    run = supervised.wait_for(supervised.trigger("always-fails", {}))
    assert run["status"] == "FAILED" and run["isFailed"]
    assert run["attemptCount"] == 2
    assert run["error"]["message"] == "nope 2" and run["error"]["name"] == "ValueError"
    assert "stackTrace" in run["error"]


def test_abort_ends_the_run_at_once(supervised: Stack) -> None:
    run = supervised.wait_for(supervised.trigger("aborts", {}))
    assert run["status"] == "FAILED" and run["attemptCount"] == 1
    assert run["error"]["message"] == "stop right there"


def test_output_that_is_not_json_fails_clearly(supervised: Stack) -> None:
    run = supervised.wait_for(supervised.trigger("not-json", {}))
    assert run["status"] == "FAILED" and "not JSON" in run["error"]["message"]


def test_outputs_over_the_request_limit_together_complete_and_one_over_the_payload_limit_fails_at_once(
        supervised: Stack) -> None:
    # four outputs of 2.75 MiB finishing together are over the 10 MiB request limit as one
    # completion request: they are sent apart and every run completes
    big = [supervised.trigger("sized-output", {"bytes": 2_883_584}) for _ in range(4)]
    too_big = supervised.trigger("sized-output", {"bytes": 3_200_000})  # over the 3 MiB payload limit
    for run_id in big:
        run = supervised.wait_for(run_id)
        assert run["status"] == "COMPLETED" and len(run["output"]) == 2_883_584, (run["status"], run.get("error"))
        assert run["attemptCount"] == 1  # its result was not lost with the others' (then run again)
    run = supervised.wait_for(too_big)
    # the same output on every attempt: failed at its first, not left EXECUTING until it is taken for stalled
    assert run["status"] == "FAILED" and run["attemptCount"] == 1, (run["status"], run["attemptCount"])
    assert run["error"]["type"] == "OUTPUT_TOO_LARGE" and "larger than" in run["error"]["message"]


def test_max_duration_times_out(supervised: Stack) -> None:
    run = supervised.wait_for(supervised.trigger("sleeper", {"seconds": 30}))
    assert run["status"] == "TIMED_OUT" and run["attemptCount"] == 1, (run["error"], run["attemptCount"])


def test_killed_executor_is_retried(supervised: Stack) -> None:
    run = supervised.wait_for(supervised.trigger("crash-once", {}))
    assert run["status"] == "COMPLETED" and run["output"]["attempt"] == 2


def test_out_of_memory_is_reported(supervised: Stack) -> None:
    run = supervised.wait_for(supervised.trigger("hog", {}))
    assert run["status"] == "FAILED" and run["error"]["type"] == "TASK_PROCESS_OOM_KILLED"


def test_out_of_memory_is_retried_on_the_larger_machine_the_task_names(supervised: Stack) -> None:
    run = supervised.wait_for(supervised.trigger("hog-then-larger", {}))
    assert run["status"] == "COMPLETED" and run["output"] == {"attempt": 2, "mib": 384}
    assert run["machine"] == "small-2x" and run["attemptCount"] == 2


def test_a_trigger_names_the_machine_to_retry_on_after_out_of_memory(supervised: Stack) -> None:
    # the task's own policy has no out_of_memory; the trigger's does
    retry = {"maxAttempts": 2, "minTimeoutInMs": 100, "outOfMemory": {"machine": "small-2x"}}
    run = supervised.wait_for(supervised.trigger("hog", {}, retry=retry))
    assert run["status"] == "COMPLETED" and run["machine"] == "small-2x" and run["attemptCount"] == 2
    with supervised.client() as c:
        bad = c.post("/api/v1/tasks/hog/trigger", json={"payload": {}, "options": {
            "retry": {"outOfMemory": {"machine": "huge-9x"}}}})
        assert bad.status_code == 400 and "outOfMemory.machine" in bad.json()["error"]["message"]


def test_cancel_queued_and_executing_runs(supervised: Stack) -> None:
    with supervised.client() as c:
        # executing
        running = supervised.trigger("long", {"seconds": 30})
        supervised.wait_for(running, lambda r: r["status"] == "EXECUTING")
        assert c.post(f"/api/v2/runs/{running}/cancel").json() == {"id": running}
        # the supervisor learns it from its next heartbeat and kills the executor: well before the
        # 60 s PENDING_CANCEL timeout would finish the run instead
        assert supervised.wait_for(running, timeout=20)["status"] == "CANCELED"
        # queued: its queue is paused so it stays queued
        assert c.post("/api/v1/queues/task/sync-echo/pause", json={"action": "pause"}).json()["paused"] is True
        queued = supervised.trigger("sync-echo", 1)
        assert supervised.run(queued)["status"] == "QUEUED"
        c.post(f"/api/v2/runs/{queued}/cancel")
        assert supervised.run(queued)["status"] == "CANCELED"
        c.post("/api/v1/queues/task/sync-echo/pause", json={"action": "resume"})
        # cancelling a finished run changes nothing
        c.post(f"/api/v2/runs/{queued}/cancel")
        assert supervised.run(queued)["status"] == "CANCELED"


def test_pause_and_resume_a_queue(supervised: Stack) -> None:
    with supervised.client() as c:
        assert c.post("/api/v1/queues/task/echo/pause", json={"action": "pause"}).status_code == 200
        run_id = supervised.trigger("echo", "paused")
        time.sleep(0.5)
        assert supervised.run(run_id)["status"] == "QUEUED"
        q = c.get("/api/v1/queues/task/echo").json()
        assert q["paused"] is True and q["queued"] >= 1
        c.post("/api/v1/queues/task/echo/pause", json={"action": "resume"})
    assert supervised.wait_for(run_id)["status"] == "COMPLETED"


def test_queue_concurrency_limit_is_never_exceeded(supervised: Stack, tmp_path: Path) -> None:
    log = tmp_path / "limited.log"
    ids = [supervised.trigger("limited", {"log": str(log)}) for _ in range(8)]
    for run_id in ids:
        assert supervised.wait_for(run_id)["status"] == "COMPLETED"
    events = sorted((json.loads(line) for line in log.read_text().splitlines()),
                    key=lambda e: (e["t"], e["event"] == "start"))
    running = peak = 0
    for e in events:
        running += 1 if e["event"] == "start" else -1
        peak = max(peak, running)
    assert peak == 2  # the limit, reached but never exceeded


def test_replay_creates_a_new_run_with_the_same_payload(supervised: Stack) -> None:
    first = supervised.wait_for(supervised.trigger("echo", {"n": 7}))
    with supervised.client() as c:
        replay = c.post(f"/api/v1/runs/{first['id']}/replay").json()["id"]
    again = supervised.wait_for(replay)
    assert replay != first["id"] and again["output"]["payload"] == {"n": 7}


def test_killed_supervisor_run_is_requeued_and_completes_on_another(stack: Stack) -> None:
    own = stack.project("failover")  # only the supervisors started here serve it
    doomed = own.start_supervisor("doomed", concurrency=1)
    run_id = own.trigger("long", {"seconds": 2})
    first = own.wait_for(run_id, lambda r: r["status"] == "EXECUTING")
    assert first["attemptCount"] == 1
    stop(doomed, signal.SIGKILL)
    own.start_supervisor("rescuer", concurrency=1)
    run = own.wait_for(run_id, timeout=60)  # after the 3 s EXECUTING heartbeat timeout
    assert run["status"] == "COMPLETED" and run["output"]["attempt"] == 2


def test_executors_are_warm_and_reused(stack: Stack) -> None:
    own = stack.project("warm")
    own.start_supervisor("warm", concurrency=1)
    pids = [own.wait_for(own.trigger("long", {"seconds": 0}))["output"]["pid"] for _ in range(3)]
    assert len(set(pids)) == 1, pids  # one executor process ran all three


def test_sigterm_drains_in_flight_runs_and_exits_zero(stack: Stack) -> None:
    own = stack.project("drain")
    sup = own.start_supervisor("drainer", concurrency=2)
    run_id = own.trigger("long", {"seconds": 1.5})
    own.wait_for(run_id, lambda r: r["status"] == "EXECUTING")
    assert stop(sup, signal.SIGTERM) == 0
    assert own.run(run_id)["status"] == "COMPLETED"  # finished before the process exited


def test_sigterm_drains_runs_handed_to_the_open_poll(stack: Stack) -> None:
    """Runs handed out while the supervisor stops are run, not left for a heartbeat timeout."""
    own = stack.project("drain-poll")
    triggered: list[str] = []
    for round_ in range(5):  # a SIGTERM at different moments of the poll
        sup = own.start_supervisor(f"drain-poll-{round_}", concurrency=4)
        runs = [own.trigger("long", {"seconds": 0.3}) for _ in range(3)]
        triggered += runs
        own.wait_for(runs[0], lambda r: r["status"] in ("EXECUTING", "COMPLETED"))
        assert stop(sup, signal.SIGTERM) == 0
        for run_id in runs:
            run = own.run(run_id)
            # handed out: finished before the process exited (never stranded EXECUTING); else still queued
            assert run["status"] in ("COMPLETED", "QUEUED"), run
    own.start_supervisor("drain-poll-last", concurrency=4)
    finished = [own.wait_for(run_id) for run_id in triggered]
    assert [(r["status"], r["attemptCount"]) for r in finished] == [("COMPLETED", 1)] * len(triggered)


def test_a_stopping_worker_ends_its_long_poll_without_runs(stack: Stack) -> None:
    own = stack.project("stop-poll")
    with own.worker() as w:
        assert w.post("/engine/v1/worker-actions/connect", json={"workerInstanceName": "p", "deployment": {
            "tasks": [{"id": "echo"}]}}).status_code == 200
        with ThreadPoolExecutor(1) as pool:
            poll = pool.submit(w.post, "/engine/v1/worker-actions/dequeue",
                               json={"workerInstanceName": "p", "maxRuns": 5, "waitMs": 60_000}, timeout=120)
            deadline = time.monotonic() + 30
            while not poll.done() and time.monotonic() < deadline:  # until the engine has seen the poll
                assert w.post("/engine/v1/worker-actions/heartbeat",
                              json={"workerInstanceName": "p", "stopping": True}).status_code == 200
                try:
                    answer = poll.result(timeout=1.0)
                except FutureTimeout:
                    continue
            answer = poll.result(timeout=0)
        assert answer.status_code == 200 and answer.json() == {"runs": []}
        # a new poll of the same worker is not ended by the old mark
        run_id = own.trigger("echo", 1)
        got = w.post("/engine/v1/worker-actions/dequeue", json={"workerInstanceName": "p", "waitMs": 5000}).json()
        assert [r["run"]["id"] for r in got["runs"]] == [run_id]


def test_a_task_triggers_a_child_with_its_run_token(supervised: Stack) -> None:
    parent = supervised.wait_for(supervised.trigger("spawns-child", {}))
    assert parent["status"] == "COMPLETED"
    child = supervised.wait_for(parent["output"]["child"])
    assert child["status"] == "COMPLETED" and child["output"]["payload"] == {"from": parent["id"]}
    assert child["relatedRuns"]["parent"] == parent["id"] and child["relatedRuns"]["root"] == parent["id"]
    assert child["depth"] == 1
    assert child["id"] in supervised.run(parent["id"])["relatedRuns"]["children"]


def test_several_supervisors_each_run_executes_exactly_once(stack: Stack, tmp_path: Path) -> None:
    own = stack.project("shared-group")
    for name in ("a", "b", "c"):
        own.start_supervisor(f"shared-{name}", concurrency=3)
    log = tmp_path / "record.log"
    ids = [own.trigger("record", {"log": str(log)}) for _ in range(40)]
    for run_id in ids:
        assert own.wait_for(run_id)["status"] == "COMPLETED"
    lines = log.read_text().split("\n")[:-1]
    assert sorted(line.split()[0] for line in lines) == sorted(ids)  # each exactly once
    assert len({line.split()[1] for line in lines}) > 1  # spread over executors


def test_self_hosted_worker_group_created_by_cli_serves_its_project(stack: Stack) -> None:
    own = stack.project("selfhosted")
    out = own.cli("worker-groups", "create", "gpu-boxes", "--org", "e2e", "--project", "selfhosted",
                  "--default", "--json")
    group = json.loads(out.stdout)
    assert group["name"] == "gpu-boxes" and group["token"].startswith("tr_wgt_")
    mine = Stack(url=own.url, env=own.env, api_key=own.api_key, token=group["token"], procs=own.procs, logs=own.logs)
    mine.start_supervisor("gpu", concurrency=1)
    assert mine.wait_for(mine.trigger("echo", "on my box"))["output"]["payload"] == "on my box"
