"""Real processes: `run-engine server` and `run-engine supervisor`, driven over HTTP only."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from ..conftest import SESSION_TAG, fresh_database, redis_is_cluster

ROOT = Path(__file__).resolve().parents[2]
FINAL = {"COMPLETED", "CANCELED", "FAILED", "CRASHED", "SYSTEM_FAILURE", "EXPIRED", "TIMED_OUT"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Stack:
    url: str
    env: dict[str, str]
    api_key: str
    token: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: Path = Path(".")

    def client(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, headers={"Authorization": f"Bearer {key or self.api_key}"})

    def worker(self) -> httpx.Client:
        return self.client(self.token)

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "run_engine.cli", *args], env=self.env, cwd=ROOT,
                              capture_output=True, text=True, check=check, timeout=120)

    def project(self, name: str) -> Stack:
        """Another project (its own environment and worker group) on the same server."""
        creds = json.loads(self.cli("bootstrap", "--org", "e2e", "--project", name, "--env", "dev").stdout)
        return Stack(url=self.url, env=self.env, api_key=creds["apiKey"], token=creds["workerGroupToken"],
                     procs=self.procs, logs=self.logs)

    def start_supervisor(self, name: str, concurrency: int = 4, tasks: str = "tests.e2e.tasks_e2e",
                         env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.logs / f"supervisor-{name}.log", "wb") as log:  # the child keeps its own copy
            proc = subprocess.Popen(
                [sys.executable, "-m", "run_engine.cli", "supervisor", "--token", self.token, "--tasks", tasks,
                 "--api-url", self.url, "--concurrency", str(concurrency), "--name", name,
                 "--heartbeat-interval", "0.5"],
                env={**self.env, **(env or {})}, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def trigger(self, task: str, payload: Any = None, **options: Any) -> str:
        with self.client() as c:
            r = c.post(f"/api/v1/tasks/{task}/trigger", json={"payload": payload, "options": options})
        assert r.status_code == 200, r.text
        return str(r.json()["id"])

    def run(self, run_id: str) -> dict[str, Any]:
        with self.client() as c:
            r = c.get(f"/api/v3/runs/{run_id}")
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        return data

    def snapshot(self, run_id: str) -> dict[str, Any]:
        """The run's latest execution snapshot (worker API)."""
        with self.worker() as c:
            r = c.get(f"/engine/v1/worker-actions/runs/{run_id}/snapshots/latest")
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()["snapshot"]
        return data

    def wait_for(self, run_id: str, pred: Callable[[dict[str, Any]], bool] = lambda r: r["status"] in FINAL,
                 timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            run = self.run(run_id)
            if pred(run):
                return run
            if time.monotonic() > deadline:
                raise AssertionError(f"run {run_id} still {run['status']} after {timeout}s")
            time.sleep(0.05)


def start_server(env: dict[str, str], log: Path, port: int | None = None,
                 **overrides: str) -> tuple[str, subprocess.Popen[bytes]]:
    """Another `run-engine server` process on the same database and Redis (with settings of its own)."""
    port = port or free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "run_engine.cli", "server", "--port", str(port)],
                                env={**env, **overrides}, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return url, proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server did not start: {log.read_text()}")
        time.sleep(0.05)


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 20) -> int | None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@pytest.fixture(scope="session")
def stack(database_url: str, redis_url: str, key_prefix: str,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # a database of its own: the server lives the whole session, and as the leader its reconciler
    # and re-arm take up what they find in its database (a bulk action pending, a run without its
    # message) into its own Redis: sharing the integration tests' database, it ran their bulk
    # actions' pages (their limit test saw fifteen actions made of ten). The same tests on a Redis
    # Cluster get another (the two stacks' servers would share runs and leader duties)
    name = "re_cluster" if redis_is_cluster(redis_url) else "re_e2e"
    with fresh_database(database_url, f"{name}_{SESSION_TAG}") as own:
        yield from _stack(own, redis_url, key_prefix, tmp_path_factory)


def _stack(database_url: str, redis_url: str, key_prefix: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    port = free_port()
    logs = tmp_path_factory.mktemp("e2e-logs")
    env = {
        **os.environ,
        "DATABASE_URL": database_url, "REDIS_URL": redis_url, "RUN_ENGINE_KEY_PREFIX": f"{key_prefix}:e2e",
        "RUN_ENGINE_SECRET": "e2e-secret-not-for-production", "RUN_ENGINE_API_URL": f"http://127.0.0.1:{port}",
        "RUN_ENGINE_EXECUTING_TIMEOUT_S": "3", "RUN_ENGINE_PENDING_EXECUTING_TIMEOUT_S": "2",
        "RUN_ENGINE_MAX_DELIVERIES": "2", "RUN_ENGINE_SUSPEND_AFTER_S": "0.5", "PYTHONPATH": str(ROOT),
    }
    boot = subprocess.run([sys.executable, "-m", "run_engine.cli", "bootstrap", "--org", "e2e", "--project", "p",
                           "--env", "dev"], env=env, cwd=ROOT, capture_output=True, text=True, check=True, timeout=120)
    creds = json.loads(boot.stdout)
    with open(logs / "server.log", "wb") as server_log:
        server = subprocess.Popen([sys.executable, "-m", "run_engine.cli", "server", "--port", str(port)],
                                  env=env, cwd=ROOT, stdout=server_log, stderr=subprocess.STDOUT)
    s = Stack(url=f"http://127.0.0.1:{port}", env=env, api_key=creds["apiKey"], token=creds["workerGroupToken"],
              procs=[server], logs=logs)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{s.url}/healthz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server did not start: {(logs / 'server.log').read_text()}")
        time.sleep(0.05)
    yield s
    for proc in reversed(s.procs):
        stop(proc)


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args: dict[str, Any]) -> dict[str, Any]:
    """Playwright drives the operating system's Chromium (its own browser download is not reachable
    from these machines): PLAYWRIGHT_CHROMIUM_EXECUTABLE_PATH, else `chromium` on the PATH."""
    import shutil

    exe = (os.environ.get("PLAYWRIGHT_CHROMIUM_EXECUTABLE_PATH") or shutil.which("chromium")
           or shutil.which("chromium-browser"))
    if exe is None:
        raise RuntimeError("no Chromium: install the operating system's chromium package (.ci/run does)")
    return {**browser_type_launch_args, "executable_path": exe,
            "args": ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                     "--disable-sync", "--no-first-run"]}


@pytest.fixture(scope="session")
def base_url() -> None:
    """pytest-base-url's fixture (pulled in by pytest-playwright) warns on this pytest; pages are
    opened with full URLs."""
    return None
