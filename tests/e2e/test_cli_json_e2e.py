"""Every CLI command takes `--json` (API.md, "CLI"): a walk over `run-engine --help` finds each
command, and each one is run with `--json` and must print JSON (one object per line)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import typer

from run_engine.cli import app

from .conftest import ROOT, Stack, free_port, stop


def _commands(group: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for name, cmd in sorted(group.commands.items()):
        if hasattr(cmd, "commands"):  # a group (typer vendors its own click)
            out += _commands(cmd, (*prefix, name))
        else:
            out.append((*prefix, name))
    return out


COMMANDS = _commands(typer.main.get_command(app))


def _json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _wait_for_json(path: Path, proc: subprocess.Popen[bytes], what: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in path.read_text().splitlines():
            if what in line:
                obj: dict[str, Any] = json.loads(line)  # the whole line is one JSON object
                return obj
        assert proc.poll() is None, path.read_text()
        time.sleep(0.1)
    raise AssertionError(f"no {what!r} line in {path.read_text()[-2000:]}")


def test_the_walk_finds_every_command_and_each_documents_json() -> None:
    assert {("server",), ("supervisor",), ("dev",), ("bootstrap",), ("migrate",), ("keys", "rotate"),
            ("worker-groups", "create"), ("trigger",), ("runs", "list"), ("dlq", "redrive"),
            ("tokens", "get")} <= set(COMMANDS)
    for command in COMMANDS:
        r = subprocess.run([sys.executable, "-m", "run_engine.cli", *command, "--help"], capture_output=True,
                           text=True, timeout=60, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
        assert r.returncode == 0 and "--json" in r.stdout, (command, r.stdout)


def test_each_command_prints_json(stack: Stack, tmp_path: Path) -> None:
    own = stack.project("cli-json")
    with own.worker() as w:
        assert w.post("/engine/v1/worker-actions/connect", json={"workerInstanceName": "j", "deployment": {
            "version": "j1", "tasks": [{"id": "echo"}]}}).status_code == 200
    run_id = own.trigger("echo", 1)
    env = {**stack.env, "RUN_ENGINE_API_KEY": own.api_key}

    def cli(*args: str) -> Any:
        r = subprocess.run([sys.executable, "-m", "run_engine.cli", *args, "--json"], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (args, r.stdout, r.stderr)
        return json.loads(r.stdout)

    token = cli("tokens", "create")["id"]
    ran: set[tuple[str, ...]] = set()
    for command, extra in (
        (("migrate",), ()), (("bootstrap",), ("--org", "e2e", "--project", "cli-json")),
        (("worker-groups", "create"), ("json-group", "--org", "e2e", "--project", "cli-json")),
        (("trigger",), ("echo", "--payload", "2")), (("runs", "list"), ()), (("runs", "get"), (run_id,)),
        (("runs", "replay"), (run_id,)), (("runs", "cancel"), (run_id,)), (("queues", "list"), ()),
        (("queues", "pause"), ("task/echo",)), (("queues", "resume"), ("task/echo",)), (("dlq", "list"), ()),
        (("dlq", "redrive"), ("--all",)), (("tokens", "get"), (token,)), (("tokens", "complete"), (token,)),
        (("tokens", "create"), ()), (("worker-groups", "list"), ()), (("promote",), ("j1",)),
        (("worker-groups", "set-default"), ("json-group", "--org", "e2e", "--project", "cli-json")),
        (("jobs", "dead"), ()), (("jobs", "retry"), ("no-such-job",)), (("jobs", "drop"), ("no-such-job",)),
        # last: the API key the commands above used stops working
        (("keys", "rotate"), ("--org", "e2e", "--project", "cli-json", "--env", "dev")),
    ):
        assert isinstance(cli(*command, *extra), dict), command
        ran.add(command)

    # the long-running ones log JSON lines with --json
    log = tmp_path / "server.log"
    port = free_port()
    with log.open("wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "run_engine.cli", "server", "--port", str(port), "--json"],
                                  env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        line = _wait_for_json(log, server, "listening")
        assert line["level"] in ("info", "debug") and line["logger"].startswith("run_engine")
    finally:
        assert stop(server) == 0
    assert all(_json_lines(log.read_text()))  # every line it wrote is JSON
    log = tmp_path / "supervisor.log"
    with log.open("wb") as out:
        sup = subprocess.Popen([sys.executable, "-m", "run_engine.cli", "supervisor", "--token", own.token, "--tasks",
                                "tests.e2e.tasks_e2e", "--api-url", stack.url, "--name", "json", "--json"],
                               env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        assert "connected" in _wait_for_json(log, sup, "connected as")["message"]
    finally:
        assert stop(sup) == 0
    log = tmp_path / "dev.log"
    with log.open("wb") as out:
        dev = subprocess.Popen([sys.executable, "-m", "run_engine.cli", "dev", "--port", str(free_port()), "--json",
                                "--tasks", "tests.e2e.tasks_e2e"], env=env, cwd=tmp_path, stdout=out,
                               stderr=subprocess.STDOUT)
    try:
        up = _wait_for_json(log, dev, '"event": "up"')
        assert up["apiKey"].startswith("tr_dev_") and up["apiUrl"].startswith("http://127.0.0.1:")
        assert up["dashboard"] == f"{up['apiUrl']}/dashboard"
    finally:
        assert stop(dev, signal.SIGINT, timeout=60) == 0
    ran |= {("server",), ("supervisor",), ("dev",)}
    assert set(COMMANDS) == ran, set(COMMANDS) ^ ran
