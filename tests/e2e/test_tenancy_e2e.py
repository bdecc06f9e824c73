"""Tenancy over HTTP (issue 10): a supervisor narrowed to an environment never receives another
environment's runs; environment-scoped worker tokens; parents of another tenant refused; keys
rotated; the installation secret never in the database and required by the server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import psycopg

from .conftest import ROOT, Stack, free_port, stop

W = "/engine/v1/worker-actions"


def _bootstrap(stack: Stack, project: str, env: str) -> dict[str, str]:
    return dict(json.loads(stack.cli("bootstrap", "--org", "e2e", "--project", project, "--env", env,
                                     "--json").stdout))


def _client(stack: Stack, key: str) -> httpx.Client:
    return httpx.Client(base_url=stack.url, timeout=30, headers={"Authorization": f"Bearer {key}"})


def test_a_supervisor_narrowed_to_dev_never_takes_production_runs(stack: Stack) -> None:
    dev = _bootstrap(stack, "narrow", "dev")
    prod = _bootstrap(stack, "narrow", "prod")
    assert dev["workerGroupToken"] == prod["workerGroupToken"]  # one group serves the project
    own = Stack(url=stack.url, env=stack.env, api_key=dev["apiKey"], token=dev["workerGroupToken"],
                procs=stack.procs, logs=stack.logs)
    # prod has its own deployment of the task (registered with prod's environment token)
    with _client(stack, prod["environmentWorkerGroupToken"]) as w:
        connected = w.post(f"{W}/connect", json={"workerInstanceName": "prod-only", "deployment": {
            "tasks": [{"id": "echo"}]}}).json()
        assert [d["environmentId"] for d in connected["deployments"]] == [prod["environmentId"]]
    with _client(stack, prod["apiKey"]) as p:
        prod_runs = [p.post("/api/v1/tasks/echo/trigger", json={"payload": i}).json()["id"] for i in range(3)]
        assert {p.get(f"/api/v3/runs/{r}").json()["status"] for r in prod_runs} == {"QUEUED"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "run_engine.cli", "supervisor", "--token", own.token, "--tasks", "tests.e2e.tasks_e2e",
         "--api-url", stack.url, "--concurrency", "4", "--name", "narrow-dev", "--env", "dev"],
        env=stack.env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        dev_runs = [own.trigger("echo", i) for i in range(5)]
        for run_id in dev_runs:
            assert own.wait_for(run_id, timeout=60)["status"] == "COMPLETED"
        with _client(stack, prod["apiKey"]) as p:
            for run_id in prod_runs:  # never handed to the dev supervisor: neither run nor failed
                run = p.get(f"/api/v3/runs/{run_id}").json()
                assert run["status"] == "QUEUED" and run["attemptCount"] == 0, run
    finally:
        stop(proc)

    # prod's own environment token dequeues prod's runs only
    with _client(stack, prod["environmentWorkerGroupToken"]) as w:
        assert w.post(f"{W}/dequeue", json={"maxRuns": 5, "environments": [dev["environmentId"]]}).status_code == 403
        got: set[str] = set()
        deadline = time.monotonic() + 20
        while set(prod_runs) - got:
            r = w.post(f"{W}/dequeue", json={"maxRuns": 10, "waitMs": 500})
            assert r.status_code == 200, r.text
            assert {i["run"]["environmentId"] for i in r.json()["runs"]} <= {prod["environmentId"]}
            got |= {i["run"]["id"] for i in r.json()["runs"]}
            assert time.monotonic() < deadline
        # a dev run is not this token's business, whatever the call
        assert w.get(f"{W}/runs/{dev_runs[0]}/snapshots/latest").status_code == 404
    with _client(stack, dev["environmentWorkerGroupToken"]) as w:
        assert w.get(f"{W}/runs/{prod_runs[0]}/snapshots/latest").status_code == 404
        assert w.get(f"{W}/runs/{dev_runs[0]}/snapshots/latest").status_code == 200


def test_an_environment_token_cannot_end_another_supervisors_long_poll(stack: Stack) -> None:
    """``heartbeat {stopping: true}`` ends the open long-poll of the instance it names: a token of one
    environment names its own instances only, never those of the group's other supervisors."""
    import concurrent.futures

    dev = _bootstrap(stack, "instances", "dev")
    prod = _bootstrap(stack, "instances", "prod")

    def stop_while_polled(stopper: str, wait_ms: int) -> float:
        """How long dev's long-poll of ``wait_ms`` lasts while ``stopper`` says dev-sup stops, again
        and again (the first may come before the long-poll is open)."""
        with concurrent.futures.ThreadPoolExecutor(1) as pool, _client(stack, stopper) as s, \
                _client(stack, dev["environmentWorkerGroupToken"]) as w:
            began = time.monotonic()
            polled = pool.submit(w.post, f"{W}/dequeue", json={"maxRuns": 1, "waitMs": wait_ms,
                                                               "workerInstanceName": "dev-sup"})
            while not polled.done():
                r = s.post(f"{W}/heartbeat", json={"workerInstanceName": "dev-sup", "stopping": True})
                assert r.status_code == 200, r.text
                assert time.monotonic() - began < 30
                time.sleep(0.2)
            assert polled.result().status_code == 200 and polled.result().json()["runs"] == []
            return time.monotonic() - began

    assert stop_while_polled(prod["environmentWorkerGroupToken"], 3000) >= 2.5  # ran its course
    assert stop_while_polled(dev["environmentWorkerGroupToken"], 20000) < 10  # its own token ends it


def test_a_batch_cannot_name_another_tenants_run_as_parent(stack: Stack) -> None:
    victim = stack.project("parent-victim")
    attacker = stack.project("parent-attacker")
    victim_run = victim.trigger("echo", "mine")
    with attacker.client() as c:
        before = len(c.get("/api/v1/runs").json()["data"])
        for path, body in (("/api/v1/tasks/batch", {"items": [
                {"task": "echo", "payload": 1},
                {"task": "echo", "payload": 2, "options": {"parentRunId": victim_run}}]}),
                ("/api/v1/tasks/echo/trigger", {"payload": 1, "options": {"parentRunId": victim_run}})):
            r = c.post(path, json=body)
            assert r.status_code == 400, r.text
            assert "parentRunId" in r.json()["error"]["message"]
        # nor through a two-phase batch's streamed items (the item fails on its own, as any bad item)
        opened = c.post("/api/v3/batches", json={"runCount": 1}).json()
        line = orjson.dumps({"index": 0, "task": "echo", "payload": 1, "options": {"parentRunId": victim_run}})
        r = c.post(f"/api/v3/batches/{opened['id']}/items", content=line,
                   headers={"Content-Type": "application/x-ndjson"})
        assert r.status_code == 200 and r.json()["itemsAccepted"] == 0, r.text
        (error,) = r.json()["errors"]
        assert error["index"] == 0 and "parentRunId" in error["error"], r.text
        assert len(c.get("/api/v1/runs").json()["data"]) == before
    assert victim.run(victim_run)["relatedRuns"]["children"] == []


def test_keys_are_rotated_and_the_old_ones_refused(stack: Stack) -> None:
    first = _bootstrap(stack, "rotating", "dev")
    rotated = json.loads(stack.cli("keys", "rotate", "--org", "e2e", "--project", "rotating", "--env", "dev",
                                   "--json").stdout)
    assert rotated["apiKey"] != first["apiKey"] and rotated["environmentId"] == first["environmentId"]
    token = json.loads(stack.cli("keys", "rotate", "--org", "e2e", "--project", "rotating", "--worker-group", "main",
                                 "--json").stdout)["workerGroupToken"]
    env_token = json.loads(stack.cli("keys", "rotate", "--org", "e2e", "--project", "rotating", "--worker-group",
                                     "main", "--env", "dev", "--json").stdout)["workerGroupToken"]
    deadline = time.monotonic() + 15  # servers cache a validated key for up to 5 s
    while True:
        old = [httpx.get(f"{stack.url}/api/v1/runs", headers={"Authorization": f"Bearer {first['apiKey']}"}),
               httpx.post(f"{stack.url}{W}/heartbeat", json={"workerInstanceName": "x"},
                          headers={"Authorization": f"Bearer {first['workerGroupToken']}"}),
               httpx.post(f"{stack.url}{W}/heartbeat", json={"workerInstanceName": "x"},
                          headers={"Authorization": f"Bearer {first['environmentWorkerGroupToken']}"})]
        if all(r.status_code == 401 for r in old):
            break
        assert time.monotonic() < deadline, [r.status_code for r in old]
        time.sleep(0.2)
    assert httpx.get(f"{stack.url}/api/v1/runs", headers={"Authorization": f"Bearer {rotated['apiKey']}"}
                     ).status_code == 200
    for t in (token, env_token):
        assert httpx.post(f"{stack.url}{W}/heartbeat", json={"workerInstanceName": "x"},
                          headers={"Authorization": f"Bearer {t}"}).status_code == 200
    # bootstrap prints the current keys again, not the rotated-away ones
    again = _bootstrap(stack, "rotating", "dev")
    assert (again["apiKey"], again["workerGroupToken"], again["environmentWorkerGroupToken"]) == \
        (rotated["apiKey"], token, env_token)


def test_the_secret_is_never_stored_and_the_server_requires_one(stack: Stack, tmp_path: Path) -> None:
    with psycopg.connect(stack.env["DATABASE_URL"]) as conn:
        rows = conn.execute("SELECT key FROM engine_setting").fetchall()
        assert ("run_engine_secret",) not in rows
        stored = conn.execute("SELECT api_key_hash FROM runtime_environment").fetchall()
        assert all(len(h) == 64 for (h,) in stored)  # hashes only
    env = {k: v for k, v in stack.env.items() if k != "RUN_ENGINE_SECRET"}
    for args in (["server", "--port", str(free_port())], ["bootstrap", "--org", "x", "--project", "y"],
                 ["keys", "rotate", "--env", "dev"]):
        r = subprocess.run([sys.executable, "-m", "run_engine.cli", *args], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert "RUN_ENGINE_SECRET is not set" in r.stderr and "Traceback" not in r.stderr
    short = {**env, "RUN_ENGINE_SECRET": "short"}
    r = subprocess.run([sys.executable, "-m", "run_engine.cli", "server", "--port", str(free_port())], env=short,
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "shorter than" in r.stderr
    assert not os.path.exists(tmp_path / ".run-engine" / "secret")  # only `dev` generates one
