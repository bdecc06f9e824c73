"""Riding out a server outage (issue 11): a completion the server could not take is retried until
it does, idempotently, so a success is never lost and the task never runs again for it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from .conftest import ROOT, Stack, free_port, start_server, stop


def test_a_completion_during_a_server_outage_is_delivered_when_it_returns(stack: Stack) -> None:
    own = stack.project("outage")
    port = free_port()
    settings = {"RUN_ENGINE_EXECUTING_TIMEOUT_S": "60"}  # the outage is shorter than the heartbeat timeout
    url, server = start_server(stack.env, stack.logs / "outage-server.log", port=port, **settings)
    with open(stack.logs / "outage-supervisor.log", "wb") as out:
        sup = subprocess.Popen(
            [sys.executable, "-m", "run_engine.cli", "supervisor", "--token", own.token, "--tasks",
             "tests.e2e.tasks_e2e", "--api-url", url, "--concurrency", "2", "--name", "outage",
             "--heartbeat-interval", "0.5"], env=stack.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        run_id = own.trigger("long", {"seconds": 3})
        own.wait_for(run_id, lambda r: r["status"] == "EXECUTING", timeout=60)
        stop(server, signal.SIGKILL)  # the run finishes while the server is gone
        time.sleep(7)
        _, server = start_server(stack.env, stack.logs / "outage-server.log", port=port, **settings)
        run = own.wait_for(run_id, timeout=60)
        assert run["status"] == "COMPLETED", run
        assert run["attemptCount"] == 1 and run["output"]["attempt"] == 1  # not run again
        log = (stack.logs / "outage-supervisor.log").read_text()
        assert "completion not taken" in log  # it was retried, not dropped
    finally:
        stop(sup)
        stop(server)
