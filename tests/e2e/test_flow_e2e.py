"""Flow control over HTTP (issue 5): delay and reschedule, TTL, idempotency keys, priority, tags and
metadata. Real server and supervisor."""

from __future__ import annotations

import concurrent.futures
import time
from datetime import UTC, datetime, timedelta

import pytest

from .conftest import Stack

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


@pytest.fixture(scope="module")
def flow(stack: Stack) -> Stack:
    own = stack.project("flow")
    own.start_supervisor("flow", concurrency=4)
    return own


def test_delay_then_reschedule_and_422_once_it_is_not_delayed(flow: Stack) -> None:
    run_id = flow.trigger("echo", {"d": 1}, delay="1h", tags=["delayed"])
    run = flow.run(run_id)
    assert run["status"] == "DELAYED" and run["isQueued"] and run["delayedUntil"]
    with flow.client() as c:
        why = c.get(f"/api/v1/runs/{run_id}/explain").json()
    assert why["reasons"][0]["code"] == "DELAYED" and why["summary"].startswith("delayed: not due until")
    soon = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    with flow.client() as c:
        r = c.post(f"/api/v1/runs/{run_id}/reschedule", json={"delay": soon})
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "DELAYED" and r.json()["delayedUntil"].startswith(soon[:19])
    done = flow.wait_for(run_id)
    assert done["status"] == "COMPLETED"
    with flow.client() as c:
        r = c.post(f"/api/v1/runs/{run_id}/reschedule", json={"delay": "10s"})
        assert r.status_code == 422 and r.json()["error"]["code"] == "not_delayed"
        bad = c.post(f"/api/v1/runs/{run_id}/reschedule", json={"delay": "tomorrowish"})
        assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("delay")
        assert c.post("/api/v1/runs/run_nope/reschedule", json={"delay": "1s"}).status_code == 404


def test_ttl_expires_a_run_that_cannot_start(flow: Stack) -> None:
    with flow.client() as c:
        assert c.post("/api/v1/queues/task/sync-echo/pause", json={"action": "pause"}).status_code == 200
    try:
        run = flow.wait_for(flow.trigger("sync-echo", 1, ttl="1s"), timeout=30)
    finally:
        with flow.client() as c:
            c.post("/api/v1/queues/task/sync-echo/pause", json={"action": "resume"})
    assert run["status"] == "EXPIRED" and run["isFailed"] and run["expiredAt"]
    assert run["error"]["type"] == "EXPIRED"


def test_fifty_concurrent_triggers_with_one_idempotency_key_make_one_run(flow: Stack) -> None:
    def one(_: int) -> dict:
        with flow.client() as c:
            r = c.post("/api/v1/tasks/echo/trigger", json={"payload": 1, "options": {"idempotencyKey": "k-50"}})
        assert r.status_code == 200, r.text
        return r.json()

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(50)))
    assert len({r["id"] for r in results}) == 1
    assert sum(not r["isCached"] for r in results) == 1
    run = flow.wait_for(results[0]["id"])
    assert run["status"] == "COMPLETED" and run["idempotencyKey"] == "k-50"
    with flow.client() as c:
        batch = c.post("/api/v1/tasks/batch", json={"items": [
            {"task": "echo", "payload": 2, "options": {"idempotencyKey": "k-50"}},
            {"task": "echo", "payload": 3, "options": {"idempotencyKey": "k-batch"}}]}).json()
    assert batch["runs"][0] == {"id": results[0]["id"], "taskIdentifier": "echo", "isCached": True}
    assert batch["runs"][1]["isCached"] is False


def test_priority_tags_and_metadata(flow: Stack) -> None:
    run_id = flow.trigger("echo", 1, priority=30, tags=["a", "b"], metadata={"step": 1})
    with flow.client() as c:
        run = c.get(f"/api/v3/runs/{run_id}").json()
        assert run["priority"] == 30 and run["tags"] == ["a", "b"] and run["metadata"] == {"step": 1}
        r = c.put(f"/api/v1/runs/{run_id}/metadata", json={"metadata": {"step": 2, "of": 3}})
        assert r.status_code == 200 and r.json() == {"metadata": {"step": 2, "of": 3}}
        r = c.post(f"/api/v1/runs/{run_id}/tags", json={"tags": ["b", "c"]})
        assert r.status_code == 200 and r.json() == {"tags": ["a", "b", "c"]}
        too_many = c.post(f"/api/v1/runs/{run_id}/tags", json={"tags": [f"t{i}" for i in range(8)]})
        assert too_many.status_code == 422
        assert c.post(f"/api/v1/runs/{run_id}/tags", json={"tags": ["x" * 129]}).status_code == 400
        huge = c.put(f"/api/v1/runs/{run_id}/metadata", json={"metadata": {"blob": "x" * 300_000}})
        assert huge.status_code == 413
        run = c.get(f"/api/v3/runs/{run_id}").json()
        assert run["metadata"] == {"step": 2, "of": 3} and run["tags"] == ["a", "b", "c"]
        tagged = c.get("/api/v1/runs", params={"filter[tag]": "c"}).json()["data"]
        assert [r["id"] for r in tagged] == [run_id]


def test_run_list_filters_by_status_task_and_queue(flow: Stack) -> None:
    delayed = flow.trigger("echo", 1, delay="1h", tags=["lf"])
    done = flow.trigger("sync-echo", 2, tags=["lf"])
    assert flow.wait_for(done)["status"] == "COMPLETED"
    with flow.client() as c:
        def ids(**params: str) -> list[str]:
            r = c.get("/api/v1/runs", params={"filter[tag]": "lf", **{f"filter[{k}]": v for k, v in params.items()}})
            assert r.status_code == 200, r.text
            return [x["id"] for x in r.json()["data"]]

        queue_of_done = c.get(f"/api/v3/runs/{done}").json()["queue"]
        assert ids(status="DELAYED") == [delayed]
        assert ids(status="COMPLETED,DELAYED") == [done, delayed]
        assert ids(taskIdentifier="sync-echo") == [done]
        assert ids(queue=queue_of_done) == [done]
        assert ids(status="FAILED") == []
        bad = c.get("/api/v1/runs", params={"filter[status]": "SLEEPY"})
        assert bad.status_code == 400 and "SLEEPY" in bad.json()["error"]["message"]
        assert c.post(f"/api/v2/runs/{delayed}/cancel").status_code == 200


def test_rate_limit_of_ten_per_second_holds_over_five_seconds(flow: Stack, tmp_path) -> None:  # type: ignore[no-untyped-def]
    log = tmp_path / "rated.log"
    with flow.client() as c:
        queue = c.get("/api/v1/queues/e2e-rated").json()
        assert queue["rateLimit"] == {"limit": 10, "periodMs": 1000, "burst": 1}
        r = c.post("/api/v1/tasks/batch", json={"items": [{"task": "rated", "payload": {"log": str(log)}}] * 60})
        assert r.status_code == 200, r.text
        ids = [x["id"] for x in r.json()["runs"]]
    for run_id in ids:
        assert flow.wait_for(run_id, timeout=60)["status"] == "COMPLETED"
    starts = sorted(float(line) for line in log.read_text().split())
    assert len(starts) == 60
    first = starts[0]
    # at most 10 starts in any one-second window (one more allowed for start-up jitter), and at
    # most 10 per second over the first five seconds
    for i, t in enumerate(starts):
        assert sum(1 for u in starts[i:] if u < t + 1.0) <= 11, starts
    assert sum(1 for t in starts if t < first + 5.0) <= 52, starts


def test_maximum_queue_length_answers_429(stack: Stack) -> None:
    import json

    full = stack.project("flow-full")
    creds = json.loads(full.cli("bootstrap", "--org", "e2e", "--project", "flow-full", "--env", "dev",
                                "--max-queue-length", "3").stdout)
    assert creds["apiKey"] == full.api_key
    full.start_supervisor("flow-full", concurrency=1)
    with full.client() as c:
        deadline = time.monotonic() + 30
        while c.post("/api/v1/queues/task/echo/pause", json={"action": "pause"}).status_code != 200:
            assert time.monotonic() < deadline, "the supervisor never registered its queues"
            time.sleep(0.1)
        for i in range(3):
            assert c.post("/api/v1/tasks/echo/trigger", json={"payload": i}).status_code == 200
        r = c.post("/api/v1/tasks/echo/trigger", json={"payload": 4})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["code"] == "queue_full" and "maximum queue length is 3" in err["message"]
        r = c.post("/api/v1/tasks/batch", json={"items": [{"task": "echo", "payload": 1}]})
        assert r.status_code == 429
        assert len(c.get("/api/v1/runs").json()["data"]) == 3  # nothing written for refused triggers


@pytest.fixture(scope="module")
def second_server(flow: Stack):  # type: ignore[no-untyped-def]
    """A second `run-engine server` process on the same database and Redis: another engine."""
    import subprocess
    import sys

    import httpx

    from .conftest import ROOT, free_port, stop

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "run_engine.cli", "server", "--port", str(port)], env=flow.env,
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, "second server did not start"
        time.sleep(0.1)
    yield url
    stop(proc)


def test_two_engine_processes_create_one_run_per_cron_tick(flow: Stack, second_server: str) -> None:
    with flow.client() as c:
        bad = c.post("/api/v1/schedules", json={"task": "echo", "cron": "every second"})
        assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("cron")
        bad = c.post("/api/v1/schedules", json={"task": "echo", "cron": "* * * * *", "timezone": "Mars/Base"})
        assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("timezone")
        sched = c.post("/api/v1/schedules", json={"task": "echo", "cron": "* * * * * *",  # every second
                                                  "externalId": "tenant-7", "deduplicationKey": "e2e-tick"})
        assert sched.status_code == 200, sched.text
        sid = sched.json()["id"]
        assert sched.json()["active"] and sched.json()["nextRun"] and sched.json()["type"] == "IMPERATIVE"

        def runs() -> list[dict]:
            return c.get("/api/v1/runs", params={"filter[tag]": f"schedule:{sid}", "page[size]": "100"}).json()["data"]

        deadline = time.monotonic() + 60
        while len(runs()) < 5:
            assert time.monotonic() < deadline, "the schedule did not fire"
            time.sleep(0.2)
        off = c.post(f"/api/v1/schedules/{sid}/deactivate")
        assert off.status_code == 200 and off.json()["active"] is False
        time.sleep(2.5)  # let ticks that were being fired land (uniqueness does not depend on it)
        fired = runs()
        ticks = [r["payload"]["timestamp"] for r in fired]
        assert len(ticks) == len(set(ticks)) >= 5, ticks  # one run per tick, never two
        assert all(r["payload"]["externalId"] == "tenant-7" for r in fired)
        assert c.get(f"/api/v1/schedules/{sid}").json()["lastRun"]
        assert sid in [s["id"] for s in c.get("/api/v1/schedules").json()["data"]]
        assert c.request("DELETE", f"/api/v1/schedules/{sid}").status_code == 200
        assert c.get(f"/api/v1/schedules/{sid}").status_code == 404


def test_sse_client_of_another_server_process_sees_queued_executing_completed(flow: Stack,
                                                                              second_server: str) -> None:
    import json
    import threading

    import httpx

    with flow.client() as c:
        assert c.post("/api/v1/queues/task/long/pause", json={"action": "pause"}).status_code == 200
    run_id = flow.trigger("long", {"seconds": 1})
    seen: list[str] = []
    closed = threading.Event()

    def listen() -> None:
        headers = {"Authorization": f"Bearer {flow.api_key}"}
        with httpx.stream("GET", f"{second_server}/realtime/v1/runs/{run_id}", headers=headers, timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            event = None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event == "run":
                    data = json.loads(line[6:])
                    assert data["id"] == run_id
                    seen.append(data["status"])
        closed.set()

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not seen:
        assert time.monotonic() < deadline, "no first event"
        time.sleep(0.05)
    with flow.client() as c:
        assert c.post("/api/v1/queues/task/long/pause", json={"action": "resume"}).status_code == 200
    assert closed.wait(60), f"stream not closed after the run finished: {seen}"
    assert seen[0] == "QUEUED" and seen[-1] == "COMPLETED" and "EXECUTING" in seen, seen
    assert seen.index("EXECUTING") < seen.index("COMPLETED") and len(seen) == len(set(seen))
    with httpx.Client() as c:
        assert c.get(f"{second_server}/realtime/v1/runs/{run_id}").status_code == 401
        other = c.get(f"{second_server}/realtime/v1/runs/run_nope", headers={"Authorization": f"Bearer {flow.api_key}"})
        assert other.status_code == 404
