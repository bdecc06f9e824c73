"""Past one process: `run-engine server --workers 3` (three processes on one port, a dead one started
again, all stopped by one SIGTERM), and three server processes with three supervisors in two worker
groups, as on several hosts behind a load balancer: every run triggered through any server is
executed once by a supervisor of its group, whichever server that supervisor talks to, and any
server answers for any run."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import ROOT, Stack, free_port, start_server, stop

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.add(int(entry.name))
    return found


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _until(check: object, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_server_workers_share_one_port(stack: Stack) -> None:
    port = free_port()
    with open(stack.logs / "server-workers.log", "wb") as log:
        parent = subprocess.Popen([sys.executable, "-m", "run_engine.cli", "server", "--workers", "3",
                                   "--port", str(port)], env=stack.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _until(lambda: len(_children(parent.pid)) == 3, "three server processes")

        _until(lambda: _answers(port), "the port answers")
        first = _children(parent.pid)
        victim = sorted(first)[0]
        os.kill(victim, signal.SIGKILL)  # a crash of one: the others go on serving, it is started again
        with httpx.Client(base_url=url, timeout=10, headers={"Authorization": f"Bearer {stack.api_key}"}) as c:
            for _ in range(30):
                assert c.get("/healthz").status_code == 200
            run_id = c.post("/api/v1/tasks/no-worker-task/trigger", json={"payload": 1}).json()["id"]
            assert c.get(f"/api/v3/runs/{run_id}").json()["status"] == "PENDING_VERSION"
        _until(lambda: len(_children(parent.pid)) == 3 and victim not in _children(parent.pid),
               "the killed server process started again")
        assert parent.poll() is None
    finally:
        parent.send_signal(signal.SIGTERM)
        code = parent.wait(60)
    assert code == 0, (stack.logs / "server-workers.log").read_text()[-3000:]
    assert _children(parent.pid) == set()


@pytest.fixture(scope="module")
def cluster(stack: Stack) -> Iterator[tuple[Stack, list[str]]]:
    """Three servers (the session's and two more), group `main` with two supervisors (each on
    another server), group `gpu` with one."""
    project = stack.project("cluster")
    extra: list[tuple[str, subprocess.Popen[bytes]]] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:  # a setup that fails half-way stops what it started
        extra += [start_server(stack.env, stack.logs / f"server-cluster-{i}.log") for i in (2, 3)]
        urls = [stack.url, *(url for url, _ in extra)]
        made = json.loads(project.cli("worker-groups", "create", "gpu", "--org", "e2e", "--project", "cluster",
                                      "--json").stdout)
        procs += [dataclasses.replace(project, url=urls[1]).start_supervisor("cluster-main-a", concurrency=3),
                  dataclasses.replace(project, url=urls[2]).start_supervisor("cluster-main-b", concurrency=3),
                  dataclasses.replace(project, url=urls[0], token=made["token"]).start_supervisor(
                      "cluster-gpu", concurrency=3)]

        def connected() -> bool:
            with project.client() as c:
                groups = {g["name"]: g for g in c.get("/api/v1/worker-groups").json()["data"]}
            return (len(groups.get("main", {}).get("instances", [])) >= 2
                    and bool(groups.get("gpu", {}).get("instances")))

        _until(connected, "every supervisor connected")
        yield project, urls
    finally:
        for proc in procs:
            stop(proc)
        for _, proc in extra:
            stop(proc)


def test_runs_through_any_server_reach_their_group_once(cluster: tuple[Stack, list[str]]) -> None:
    project, urls = cluster
    clients = [httpx.Client(base_url=u, timeout=30, headers={"Authorization": f"Bearer {project.api_key}"})
               for u in urls]
    try:
        sent: dict[str, str] = {}
        for i in range(45):
            options = {"workerGroup": "gpu"} if i % 3 == 0 else {}
            r = clients[i % 3].post("/api/v1/tasks/echo/trigger", json={"payload": {"i": i}, "options": options})
            assert r.status_code == 200, r.text
            sent[r.json()["id"]] = "gpu" if options else "main"
        # a live shape on the third server follows a run triggered through the first
        followed = next(iter(sent))
        offset, status = "-1", ""
        deadline = time.monotonic() + 60
        while status != "COMPLETED_SUCCESSFULLY":  # the raw TaskRun status the SDK maps to COMPLETED
            params = {"offset": offset} | ({"live": "true"} if offset != "-1" else {})
            r = clients[2].get(f"/realtime/v1/runs/{followed}", params=params, timeout=40)
            assert r.status_code == 200, r.text
            offset = r.headers["electric-offset"]
            for message in r.json():
                status = message.get("value", {}).get("status", status)
            assert time.monotonic() < deadline, f"the shape never showed {followed} finished"
        for n, (run_id, group) in enumerate(sent.items()):
            run = None
            deadline = time.monotonic() + 60
            while run is None or run["status"] != "COMPLETED":  # read through another server than the trigger's
                run = clients[(n + 1) % 3].get(f"/api/v3/runs/{run_id}").json()
                assert time.monotonic() < deadline, f"{run_id} ({group}) is {run['status']}"
                time.sleep(0.05)
            assert run["attemptCount"] == 1, run
            assert run["output"]["payload"] == {"i": n}
            with project.worker() as w:  # the main group's token sees its own group's runs only
                seen = w.get(f"/engine/v1/worker-actions/runs/{run_id}/snapshots/latest").status_code
            assert seen == (200 if group == "main" else 404), (run_id, group, seen)
    finally:
        for c in clients:
            c.close()


def test_server_workers_asked_for_by_the_environment_serve(stack: Stack) -> None:
    """``RUN_ENGINE_WORKERS=2`` (a deployment's environment) starts two server processes that
    serve the port, like ``--workers 2``: the children do not read it as their own count (each
    tried to start two more and could not listen)."""
    port = free_port()
    argv = [sys.executable, "-m", "run_engine.cli", "server", "--port", str(port)]
    with open(stack.logs / "server-workers-env.log", "wb") as log:
        parent = subprocess.Popen(argv, env={**stack.env, "RUN_ENGINE_WORKERS": "2"}, cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT)
    try:
        _until(lambda: len(_children(parent.pid)) == 2, "two server processes")
        children = _children(parent.pid)

        _until(lambda: _answers(port), "the server processes answering")
        assert _children(parent.pid) == children  # none died and was started again
        assert b"cannot listen" not in (stack.logs / "server-workers-env.log").read_bytes()
    finally:
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(60) == 0


def test_server_workers_end_with_their_parent(stack: Stack) -> None:
    """A parent killed outright (SIGKILL, the OOM killer) takes its server processes with it: none
    is left holding the port, so a restart can listen on it again."""
    port = free_port()
    argv = [sys.executable, "-m", "run_engine.cli", "server", "--workers", "2", "--port", str(port)]
    with open(stack.logs / "server-workers-orphans.log", "wb") as log:
        parent = subprocess.Popen(argv, env=stack.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    _until(lambda: len(_children(parent.pid)) == 2, "two server processes")
    children = _children(parent.pid)
    parent.kill()
    parent.wait(30)
    _until(lambda: not any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in children),
           "the server processes ended with their parent")
    with open(stack.logs / "server-workers-orphans.log", "ab") as log:
        again = subprocess.Popen(argv, env=stack.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        _until(lambda: _answers(port), "a new server on the same port")
    finally:
        again.send_signal(signal.SIGTERM)
        assert again.wait(60) == 0


def _state(pid: int) -> str:
    try:
        return "zombie" if (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z") else "alive"
    except OSError:
        return "gone"
