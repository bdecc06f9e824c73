"""A cancel reaches an executing run's executor at once (pushed through a long-poll), not at the
run's next heartbeat: here heartbeats are two minutes apart and the pending-cancel timeout is a
minute, so a run that ends CANCELED well before either was stopped by the push."""

from __future__ import annotations

import subprocess
import sys

from .conftest import ROOT, Stack, stop


def test_cancel_stops_an_executing_run_before_its_next_heartbeat(stack: Stack) -> None:
    own = stack.project("cancel-push")
    with open(own.logs / "supervisor-cancel-push.log", "wb") as log:
        sup = subprocess.Popen(
            [sys.executable, "-m", "run_engine.cli", "supervisor", "--token", own.token, "--tasks",
             "tests.e2e.tasks_e2e", "--api-url", own.url, "--concurrency", "2", "--name", "cancel-push",
             "--heartbeat-interval", "120"],
            env={**own.env, "RUN_ENGINE_PENDING_CANCEL_TIMEOUT_S": "60"}, cwd=ROOT, stdout=log,
            stderr=subprocess.STDOUT)
    try:
        run_id = own.trigger("long", {"seconds": 600})
        own.wait_for(run_id, lambda r: r["status"] == "EXECUTING")
        # the watch opens after the run has executed a second: cancel once the supervisor holds it
        own.wait_for(run_id, lambda r: r["status"] == "EXECUTING" and _has_watch(own, run_id), timeout=30)
        with own.client() as c:
            assert c.post(f"/api/v2/runs/{run_id}/cancel").status_code == 200
        done = own.wait_for(run_id, timeout=30)  # < the 60 s pending-cancel timeout and the 120 s heartbeat
        assert done["status"] == "CANCELED"
        assert own.snapshot(run_id)["executionStatus"] == "FINISHED"
        assert "was cancelled: stopping its executor" in (own.logs / "supervisor-cancel-push.log").read_text()
    finally:
        assert stop(sup) == 0


def _has_watch(own: Stack, run_id: str) -> bool:
    """The supervisor logs nothing when it starts watching; a run that has executed for two seconds
    is watched (CANCEL_WATCH_AFTER_S is one)."""
    import time
    from datetime import datetime

    started = own.run(run_id).get("startedAt")
    if not started:
        return False
    age = time.time() - datetime.fromisoformat(started.replace("Z", "+00:00")).timestamp()
    return age > 2.0
