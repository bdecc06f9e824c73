"""The CLI as a user types it: client commands against a real server, and `run-engine dev` on the
embedded default from an empty directory."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .conftest import ROOT, Stack, free_port, stop


@pytest.fixture(scope="module")
def cli_project(stack: Stack) -> Stack:
    own = stack.project("cli")
    own.start_supervisor("cli", concurrency=2)
    own.env = {**own.env, "RUN_ENGINE_API_KEY": own.api_key, "RUN_ENGINE_API_URL": own.url}
    return own


def test_trigger_wait_json_then_runs_commands(cli_project: Stack) -> None:
    out = cli_project.cli("trigger", "echo", "--payload", '{"a": 1}', "--wait", "--json")
    run = json.loads(out.stdout)
    assert run["status"] == "COMPLETED" and run["output"]["payload"] == {"a": 1}
    listed = json.loads(cli_project.cli("runs", "list", "--json", "--task", "echo").stdout)
    assert run["id"] in [r["id"] for r in listed["data"]]
    got = json.loads(cli_project.cli("runs", "get", run["id"], "--json").stdout)
    assert got["id"] == run["id"]
    replay = json.loads(cli_project.cli("runs", "replay", run["id"], "--json").stdout)
    assert cli_project.wait_for(replay["id"])["status"] == "COMPLETED"
    table = cli_project.cli("runs", "list").stdout
    assert run["id"] in table and "COMPLETED" in table


def test_trigger_wait_of_a_failing_run_exits_nonzero(cli_project: Stack) -> None:
    out = cli_project.cli("trigger", "aborts", "--wait", "--json", check=False)
    assert out.returncode == 1 and json.loads(out.stdout)["status"] == "FAILED"


def test_version() -> None:
    out = subprocess.run([sys.executable, "-m", "run_engine.cli", "--version"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and re.fullmatch(r"run-engine \d+\.\d+\.\d+\S*\n", out.stdout), out


def test_trigger_wait_of_a_run_that_cannot_start_says_why(cli_project: Stack) -> None:
    out = cli_project.cli("trigger", "no-such-task", "--wait", "--timeout", "4", check=False)
    assert out.returncode == 1, out
    assert "PENDING_VERSION" in out.stderr and "no deployment of this environment has the task" in out.stderr, out


def test_tokens_commands_release_a_waiting_run(cli_project: Stack) -> None:
    token = json.loads(cli_project.cli("tokens", "create", "--timeout", "1h", "--tag", "cli", "--json").stdout)
    assert token["url"] and not token["isCached"]
    run_id = cli_project.trigger("waits-for-token", {"token": token["id"]})
    cli_project.wait_for(run_id, lambda r: r["status"] == "WAITING")
    done = cli_project.cli("tokens", "complete", token["id"], "--data", '{"ok": 1}')
    assert token["id"] in done.stdout
    assert cli_project.wait_for(run_id)["output"]["output"] == {"ok": 1}
    shown = json.loads(cli_project.cli("tokens", "get", token["id"], "--json").stdout)
    assert shown["status"] == "COMPLETED"
    bad = cli_project.cli("tokens", "complete", token["id"], "--data", "{nope", check=False)
    assert bad.returncode == 2 and "--data is not JSON" in bad.stderr
    missing = cli_project.cli("tokens", "get", "waitpoint_nope", check=False)
    assert missing.returncode == 1 and "404" in missing.stderr


def test_queue_and_dlq_commands(cli_project: Stack) -> None:
    paused = json.loads(cli_project.cli("queues", "pause", "task/sync-echo", "--json").stdout)
    assert paused["paused"] is True
    queued = json.loads(cli_project.cli("trigger", "sync-echo", "--payload", "1", "--json").stdout)
    assert cli_project.run(queued["id"])["status"] == "QUEUED"
    cancelled = json.loads(cli_project.cli("runs", "cancel", queued["id"], "--json").stdout)
    assert cancelled == {"id": queued["id"]} and cli_project.run(queued["id"])["status"] == "CANCELED"
    resumed = json.loads(cli_project.cli("queues", "resume", "task/sync-echo", "--json").stdout)
    assert resumed["paused"] is False
    queues = json.loads(cli_project.cli("queues", "list", "--json").stdout)["data"]
    assert "task/sync-echo" in {q["name"] for q in queues}
    assert json.loads(cli_project.cli("dlq", "list", "--json").stdout) == {"data": [], "pagination": {}}
    assert json.loads(cli_project.cli("dlq", "redrive", "--all", "--json").stdout) == {"redriven": 0}


def test_bad_input_and_credentials_give_clear_errors(cli_project: Stack) -> None:
    bad = cli_project.cli("trigger", "echo", "--payload", "{nope", check=False)
    assert bad.returncode == 2 and "not JSON" in bad.stderr
    missing = cli_project.cli("runs", "get", "run_missing", check=False)
    assert missing.returncode == 1 and "404" in missing.stderr
    env = {**cli_project.env, "RUN_ENGINE_API_KEY": "tr_dev_wrong"}
    wrong = subprocess.run([sys.executable, "-m", "run_engine.cli", "runs", "list"], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 1 and "401" in wrong.stderr


def test_dev_starts_everything_on_the_embedded_default(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "REDIS_URL", "RUN_ENGINE_SECRET", "RUN_ENGINE_KEY_PREFIX")}
    env.update({"RUN_ENGINE_REDIS_PORT": "0", "PYTHONPATH": str(ROOT), "COLUMNS": "60"})  # narrow: nothing wraps
    log_path = tmp_path / "dev.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "run_engine.cli", "dev", "--port", str(port)],
                                cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        key = None
        while key is None:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            found = re.search(r"API key\s+(tr_dev_\w+)", log_path.read_text())
            key = found.group(1) if found else None
            time.sleep(0.1)
        headers = {"Authorization": f"Bearer {key}"}
        url = f"http://127.0.0.1:{port}"
        while True:
            try:
                r = httpx.post(f"{url}/api/v1/tasks/hello-world/trigger", json={"payload": {"name": "Ada"}},
                               headers=headers, timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        run_id = r.json()["id"]
        while (run := httpx.get(f"{url}/api/v3/runs/{run_id}", headers=headers).json())["status"] != "COMPLETED":
            assert time.monotonic() < deadline, run
            time.sleep(0.1)
        assert run["output"]["message"] == "Hello, Ada!"
        banner = log_path.read_text()  # the lines to copy are whole however narrow the terminal
        assert re.search(rf"export RUN_ENGINE_API_URL={url} RUN_ENGINE_API_KEY={key}\n", banner), banner
        assert f'curl -s -X POST {url}/api/v1/tasks/hello-world/trigger \\\n' in banner, banner
        assert f"dashboard {url}/dashboard" in banner, banner
        second = subprocess.run([sys.executable, "-m", "run_engine.cli", "dev", "--port", str(port)], cwd=tmp_path,
                                env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and f"port {port} is in use" in second.stderr, second
        assert "Traceback" not in second.stderr + second.stdout
        assert (tmp_path / ".run-engine" / "pgdata" / "PG_VERSION").exists()
        secret = tmp_path / ".run-engine" / "secret"  # generated for dev, readable by its owner only
        assert secret.exists() and secret.stat().st_mode & 0o777 == 0o600
        code = stop(proc, signal.SIGINT, timeout=60)
        assert code == 0, (code, log_path.read_text()[-3000:])
        assert "stopped" in log_path.read_text()
        assert "Traceback" not in log_path.read_text(), log_path.read_text()[-3000:]  # Ctrl-C stops quietly
    finally:
        if proc.poll() is None:
            proc.kill()


def test_trigger_flags_and_a_readable_run(cli_project: Stack) -> None:
    out = cli_project.cli("trigger", "echo", "--payload", '{"a": 1}', "--delay", "1h", "--ttl", "2h", "--tag", "one",
                          "--tag", "two", "--idempotency-key", "cli-flags", "--concurrency-key", "k",
                          "--max-attempts", "2", "--json")
    created = json.loads(out.stdout)
    run = cli_project.run(created["id"])
    assert run["status"] == "DELAYED" and run["tags"] == ["one", "two"] and run["ttl"] == "2h"
    assert run["idempotencyKey"] == "cli-flags" and run["concurrencyKey"] == "k" and run["maxAttempts"] == 2
    again = json.loads(cli_project.cli("trigger", "echo", "--idempotency-key", "cli-flags", "--json").stdout)
    assert again["id"] == created["id"] and again["isCached"] is True
    # a failed run reads as a person reads it: status, timeline, the error and its stack on lines of their own
    failed = cli_project.cli("trigger", "aborts", "--wait", check=False)
    assert failed.returncode == 1 and "FAILED" in failed.stdout and "timeline" in failed.stdout
    run_id = re.search(r"(run_[a-z0-9]+)", failed.stdout).group(1)  # type: ignore[union-attr]
    shown = cli_project.cli("runs", "get", run_id).stdout
    assert "FAILED" in shown and "created" in shown and "error" in shown
    assert "\nTraceback" in shown or "\n  Traceback" in shown, shown
    assert "\\n" not in shown  # the stack is lines, not one escaped string


def test_help_reads_well() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
    top = subprocess.run([sys.executable, "-m", "run_engine.cli", "--help"], capture_output=True, text=True,
                         timeout=60, env=env).stdout
    assert "<bool>" not in top and "--version" in top
    # a summary is its docstring's first paragraph on one line: no line of the list ends mid-sentence at "and"
    assert not re.search(r"group\) and\s*│", top), top
    server = subprocess.run([sys.executable, "-m", "run_engine.cli", "server", "--help"], capture_output=True,
                            text=True, timeout=60, env=env).stdout
    assert "--database-url" in server and "--redis-url" in server and "<bool>" not in server
    trigger = subprocess.run([sys.executable, "-m", "run_engine.cli", "trigger", "--help"], capture_output=True,
                             text=True, timeout=60, env=env).stdout
    for flag in ("--delay", "--ttl", "--tag", "--idempotency-key", "--queue"):
        assert flag in trigger, flag


def test_trigger_with_a_debounce_key(cli_project: Stack) -> None:
    """`trigger --debounce-key`: the second trigger within the delay answers with the first run; a
    trailing one gives it its payload; a bad mode is the server's 400, said plainly."""
    key = f"cli-{time.time_ns()}"
    args = ("--debounce-key", key, "--debounce-delay", "1h", "--json")
    first = json.loads(cli_project.cli("trigger", "echo", "--payload", '{"n": 1}', *args).stdout)
    again = json.loads(cli_project.cli("trigger", "echo", "--payload", '{"n": 2}', *args,
                                       "--debounce-mode", "trailing", "--debounce-max-delay", "2h").stdout)
    assert again == {"id": first["id"], "isCached": True}
    run = cli_project.run(first["id"])
    assert run["status"] == "DELAYED" and run["payload"] == {"n": 2}
    bad = cli_project.cli("trigger", "echo", "--debounce-key", key, "--debounce-mode", "sideways", check=False)
    assert bad.returncode == 1 and "debounce.mode" in bad.stderr
