"""A rolling deploy (issue 11): an old supervisor with one task and a new one with all of them on
the same worker group. The old one is never handed a run of a task it lacks, so nothing fails
"no task in this worker": the new one runs them all."""

from __future__ import annotations

import subprocess
import sys
import time

from .conftest import ROOT, Stack, stop


def _supervisor(stack: Stack, own: Stack, name: str, tasks: str) -> subprocess.Popen[bytes]:
    with open(stack.logs / f"rolling-{name}.log", "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "run_engine.cli", "supervisor", "--token", own.token, "--tasks", tasks,
             "--api-url", stack.url, "--concurrency", "4", "--name", name, "--heartbeat-interval", "0.5"],
            env=stack.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def _connected(stack: Stack, proc: subprocess.Popen[bytes], name: str) -> None:
    deadline = time.monotonic() + 60
    while "connected as" not in (stack.logs / f"rolling-{name}.log").read_text():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)


def test_an_old_worker_never_fails_the_runs_of_a_task_it_lacks(stack: Stack) -> None:
    own = stack.project("rolling")
    old = _supervisor(stack, own, "old", "tests.e2e.tasks_old")
    try:
        _connected(stack, old, "old")
        new = _supervisor(stack, own, "new", "tests.e2e.tasks_e2e")
        try:
            _connected(stack, new, "new")
            runs = [own.trigger("sync-echo", i) for i in range(12)] + [own.trigger("echo", i) for i in range(12)]
            finished = [own.wait_for(r, timeout=90) for r in runs]
        finally:
            stop(new)
    finally:
        stop(old)
    assert [r["status"] for r in finished] == ["COMPLETED"] * 24, [r.get("error") for r in finished]
    assert all(r["attemptCount"] == 1 for r in finished)
    assert "TASK_NOT_FOUND" not in (stack.logs / "rolling-old.log").read_text()
