"""Metrics and logs end to end (issue 13): a server of its own with RUN_ENGINE_METRICS_TOKEN and JSON
logs, a supervisor with --metrics-port, real work in a project of its own. Both are scraped before
and after, and the numbers must move with the work; /metrics is closed to tenants and to the world;
a failed and a cancelled run are one JSON line each, a succeeded run none; a 4xx is in the access log.

Other servers on the same database and Redis also run engine jobs (timeouts), so counters fed by
jobs may move in another process: the assertions on counters say "at least", and the gauges read
from Redis and PostgreSQL at scrape time are exact."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import ROOT, Stack, free_port, start_server, stop

TOKEN = "e2e-metrics-token-0123456789abcdef"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@dataclass
class Observed:
    stack: Stack  # the project's keys, on the server of this module
    env_id: str
    worker_group_id: str
    log: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    supervisor_url: str = ""

    def start_supervisor(self) -> None:
        port = free_port()
        with open(self.stack.logs / "supervisor-metrics.log", "wb") as out:
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "run_engine.cli", "supervisor", "--tasks", "tests.e2e.tasks_e2e",
                 "--api-url", self.stack.url, "--concurrency", "3", "--name", "metrics", "--heartbeat-interval", "0.5",
                 "--metrics-port", str(port)],
                env={**self.stack.env, "RUN_ENGINE_WORKER_TOKEN": self.stack.token}, cwd=ROOT, stdout=out,
                stderr=subprocess.STDOUT))
        self.supervisor_url = f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def observed(stack: Stack) -> Iterator[Observed]:
    creds = json.loads(stack.cli("bootstrap", "--org", "e2e", "--project", "metrics", "--env", "dev").stdout)
    log = stack.logs / "metrics-server.log"
    url, server = start_server(stack.env, log, RUN_ENGINE_METRICS_TOKEN=TOKEN, RUN_ENGINE_LOG_FORMAT="json")
    mine = Stack(url=url, env={**stack.env, "RUN_ENGINE_API_URL": url}, api_key=creds["apiKey"],
                 token=creds["workerGroupToken"], logs=stack.logs)
    out = Observed(mine, creds["environmentId"], creds["workerGroupId"], log, [server])
    yield out
    for proc in reversed(out.procs):
        stop(proc)


def parse(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(url: str, token: str | None = TOKEN) -> Samples:
    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"} if token else {}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return parse(r.text)


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def until(what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def scrape_supervisor(url: str) -> Samples | None:
    try:
        return parse(httpx.get(f"{url}/metrics", timeout=5).text)
    except httpx.TransportError:
        return None


def log_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def test_metrics_are_closed_to_tenants_and_the_world(observed: Observed, stack: Stack) -> None:
    s = observed.stack
    for headers in ({}, {"Authorization": f"Bearer {s.api_key}"}, {"Authorization": f"Bearer {s.token}"},
                    {"Authorization": f"Bearer {TOKEN[:-1]}"}, {"Authorization": f"Basic {TOKEN}"}):
        r = httpx.get(f"{s.url}/metrics", headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", (headers, r.text)
        assert "run_engine" not in r.text
    assert "run_engine_runs_created_total" in httpx.get(f"{s.url}/metrics", timeout=30,
                                                        headers={"Authorization": f"Bearer {TOKEN}"}).text
    # a server without RUN_ENGINE_METRICS_TOKEN does not serve them at all
    r = httpx.get(f"{stack.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_the_numbers_move_with_the_work(observed: Observed, stack: Stack) -> None:
    s, env, group = observed.stack, observed.env_id, observed.worker_group_id
    before = scrape(s.url)
    assert value(before, "run_engine_worker_instances_connected", worker_group_id=group) == 0
    assert value(before, "run_engine_env_runs_queued", env_id=env) == 0

    observed.start_supervisor()
    sup_before = until("the supervisor's metrics answer", lambda: scrape_supervisor(observed.supervisor_url))
    until("the supervisor is connected", lambda: value(
        scrape(s.url), "run_engine_worker_instances_connected", worker_group_id=group) == 1)

    # queued: a paused queue keeps its runs
    with s.client() as c:
        assert c.post("/api/v1/queues/task/echo/pause", json={"action": "pause"}).status_code == 200
    echoes = [s.trigger("echo", i) for i in range(3)]
    queued = scrape(s.url)
    assert value(queued, "run_engine_queue_runs_queued", env_id=env, queue="task/echo") == 3
    assert value(queued, "run_engine_env_runs_queued", env_id=env) == 3

    # running: a run that sleeps past its max duration (its executor is killed: a restart)
    sleeper = s.trigger("sleeper", {"seconds": 30})
    # a scrape reads the environments' counts before the queues' (separate round trips): a run
    # dequeued in between shows in the queue's gauge only, so both are waited for in one scrape
    until("the sleeper holds a slot", lambda: (lambda m: value(
        m, "run_engine_queue_runs_running", env_id=env, queue="task/sleeper") == 1
        and value(m, "run_engine_env_runs_running", env_id=env) >= 1)(scrape(s.url)))
    aborts = s.trigger("aborts", {})
    # a suspension: the run waits for a token longer than the supervisor's 0.5 s
    with s.client() as c:
        token = c.post("/api/v1/waitpoints/tokens", json={}).json()["id"]
    waiter = s.trigger("waits-for-token", {"token": token})
    until("the waiting run is suspended", lambda: s.snapshot(waiter)["executionStatus"] == "SUSPENDED")
    with s.client() as c:
        assert c.post(f"/api/v1/waitpoints/tokens/{token}/complete", json={"data": 1}).status_code == 200
        assert c.post("/api/v1/queues/task/echo/pause", json={"action": "resume"}).status_code == 200
    assert s.wait_for(sleeper)["status"] == "TIMED_OUT"
    assert s.wait_for(aborts)["status"] == "FAILED"
    assert s.wait_for(waiter)["status"] == "COMPLETED"
    assert all(s.wait_for(r)["status"] == "COMPLETED" for r in echoes)

    after = scrape(s.url)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("run_engine_runs_created_total", status="QUEUED") >= 6
    assert moved("run_engine_runs_finished_total", status="COMPLETED") >= 4
    assert moved("run_engine_runs_finished_total", status="FAILED") >= 1
    assert moved("run_engine_runs_finished_total", status="TIMED_OUT") >= 1
    assert moved("run_engine_trigger_to_start_seconds_count") >= 6
    assert moved("run_engine_dequeue_seconds_count", outcome="runs") >= 1
    assert total(after, "run_engine_lock_wait_seconds_count") > total(before, "run_engine_lock_wait_seconds_count")
    assert moved("run_engine_run_events_total", event="run_suspended") >= 1
    assert moved("run_engine_run_events_total", event="run_continued") >= 1
    assert value(after, "run_engine_env_runs_queued", env_id=env) == 0
    assert value(after, "run_engine_queue_runs_queued", env_id=env, queue="task/echo") == 0
    assert value(after, "run_engine_engine_jobs_lag_seconds") >= 0
    assert ("run_engine_engine_jobs_scheduled", frozenset()) in after
    assert value(after, "run_engine_metrics_truncated", what="queues") == 0

    sup_after = until("the supervisor's executors are back", lambda: (lambda m: m if m and value(
        m, "run_engine_supervisor_executors", state="busy") == 0 else None)(scrape_supervisor(observed.supervisor_url)))

    def sup_moved(name: str) -> float:
        return value(sup_after, name) - value(sup_before, name)

    assert sup_moved("run_engine_supervisor_runs_started_total") >= 7  # the waiter twice: started, restored
    assert sup_moved("run_engine_supervisor_runs_completed_total") >= 6
    assert sup_moved("run_engine_supervisor_suspends_total") >= 1
    assert sup_moved("run_engine_supervisor_executor_restarts_total") >= 1  # the sleeper's
    assert value(sup_after, "run_engine_supervisor_executors", state="idle") >= 1
    assert value(sup_after, "run_engine_supervisor_concurrency") == 3


def test_a_dead_lettered_run_is_counted_in_its_dlq(observed: Observed) -> None:
    """A worker that dequeues and never starts: twice past the 2 s timeout (max deliveries 2) → DLQ."""
    creds = json.loads(observed.stack.cli("bootstrap", "--org", "e2e", "--project", "metrics-dlq", "--env",
                                          "dev").stdout)
    url, env = observed.stack.url, creds["environmentId"]
    assert value(scrape(url), "run_engine_dlq_runs", env_id=env) == 0
    worker = httpx.Client(base_url=f"{url}/engine/v1/worker-actions", timeout=30,
                          headers={"Authorization": f"Bearer {creds['workerGroupToken']}"})
    api = httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {creds['apiKey']}"})
    with worker, api:
        assert worker.post("/connect", json={"workerInstanceName": "idle",
                                             "deployment": {"tasks": [{"id": "t"}]}}).status_code == 200
        run_id = api.post("/api/v1/tasks/t/trigger", json={"payload": 1}).json()["id"]

        def status() -> str:
            return str(api.get(f"/api/v3/runs/{run_id}").json()["status"])

        for _ in range(2):
            got = until("the run is handed out", lambda: worker.post("/dequeue", json={
                "maxRuns": 1, "waitMs": 1000}).json()["runs"])
            assert got[0]["run"]["id"] == run_id
            until("the delivery times out", lambda: status() in ("QUEUED", "SYSTEM_FAILURE"))
        until("the run is dead-lettered", lambda: status() == "SYSTEM_FAILURE")
    after = until("the DLQ gauge moves", lambda: (lambda m: m if value(
        m, "run_engine_dlq_runs", env_id=env) == 1 else None)(scrape(url)))
    assert value(after, "run_engine_env_runs_running", env_id=env) == 0


def test_state_changes_are_one_json_line_and_success_none(observed: Observed) -> None:
    s, env = observed.stack, observed.env_id
    if not observed.procs[1:]:
        observed.start_supervisor()
    ok = s.trigger("echo", "fine")
    failed = s.trigger("aborts", {})
    delayed = s.trigger("echo", "later", delay="1h")
    with s.client() as c:
        assert c.post(f"/api/v2/runs/{delayed}/cancel").status_code == 200
    assert s.wait_for(ok)["status"] == "COMPLETED" and s.wait_for(failed)["status"] == "FAILED"
    assert s.wait_for(delayed)["status"] == "CANCELED"
    final = {run_id: s.snapshot(run_id)["id"] for run_id in (failed, delayed)}

    def line_of(run_id: str, event: str) -> dict[str, Any] | None:
        return next((x for x in log_lines(observed.log) if x.get("run_id") == run_id and x.get("event") == event),
                    None)

    fail = until("the failure is logged", lambda: line_of(failed, "run_failed"))
    assert (fail["level"], fail["logger"], fail["env_id"], fail["snapshot_id"], fail["attempt"], fail["status"]) == (
        "warning", "run_engine.runs", env, final[failed], 1, "FAILED")
    assert fail["error_type"] == "ABORT" and fail["error_message"] == "stop right there"
    cancel = until("the cancel is logged", lambda: line_of(delayed, "run_cancelled"))
    assert (cancel["level"], cancel["env_id"], cancel["snapshot_id"], cancel["attempt"], cancel["status"]) == (
        "info", env, final[delayed], 0, "CANCELED")
    lines = log_lines(observed.log)
    assert [x for x in lines if x.get("run_id") == failed and x["logger"] == "run_engine.runs"] == [fail]
    assert not [x for x in lines if ok in json.dumps(x)], "a succeeded run logs nothing at INFO"


def test_a_4xx_is_in_the_access_log_without_query_or_credentials(observed: Observed) -> None:
    s = observed.stack
    with s.client() as c:
        assert c.get("/api/v3/runs/run_nosuchrun0000000000?token=hunter2-in-a-query").status_code == 404
        assert c.get("/api/v1/runs").status_code == 200

    def access() -> list[dict[str, Any]]:
        return [x for x in log_lines(observed.log) if x["logger"] == "run_engine.access"]

    line = until("the 404 is logged", lambda: next(
        (x for x in access() if x["path"] == "/api/v3/runs/run_nosuchrun0000000000"), None))
    assert (line["level"], line["method"], line["status"], line["message"]) == ("info", "GET", 404, "request")
    assert line["duration_ms"] >= 0 and line["client"] == "127.0.0.1"
    assert any(x["path"] == "/metrics" and x["status"] == 401 for x in access())  # refused scrapes are seen
    assert not [x for x in access() if x["status"] < 400], "successful requests are DEBUG"
    text = observed.log.read_text()
    assert "hunter2" not in text and s.api_key not in text and TOKEN not in text
