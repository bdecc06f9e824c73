"""Riding out a server outage (issue 11): a completion the server could not take is retried until
it does, idempotently, so a success is never lost and the task never runs again for it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .conftest import ROOT, Stack, free_port, start_server, stop
from .proxy import CuttableProxy


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
        started = stack.logs / f"outage-long-started-{port}"
        run_id = own.trigger("long", {"seconds": 3, "started": str(started)})
        # running in its executor: EXECUTING alone is not enough (the server commits the start
        # before the dequeue's answer reaches the supervisor; killed in between, the run would
        # only come back at its heartbeat timeout)
        deadline = time.monotonic() + 60
        while not started.exists():
            assert time.monotonic() < deadline, own.run(run_id)
            time.sleep(0.05)
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


def _proxied(variable: str, value: str) -> tuple[CuttableProxy, str]:
    """A proxy in front of the server ``value`` names, and ``value`` pointed at the proxy."""
    if variable == "DATABASE_URL":  # a conninfo string or a URL
        params = conninfo_to_dict(value)
        proxy = CuttableProxy(params.get("host") or "127.0.0.1", int(params.get("port") or 5432))
        return proxy, make_conninfo(**{**params, "host": "127.0.0.1", "port": str(proxy.port)})
    parts = urlsplit(value)
    proxy = CuttableProxy(parts.hostname or "127.0.0.1", parts.port or 6379)
    auth = parts.netloc.rpartition("@")[0]
    return proxy, urlunsplit(parts._replace(netloc=f"{auth + '@' if auth else ''}127.0.0.1:{proxy.port}"))


def _answers_503(url: str, api_key: str, dependency: str, seen: list[str]) -> bool:
    try:
        health = httpx.get(f"{url}/healthz", timeout=15)
        # a call that needs the dependency (runs are listed from PostgreSQL, the DLQ from Redis)
        path = "/api/v1/runs" if dependency == "postgres" else "/api/v1/dlq"
        call = httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
    except httpx.TransportError as exc:
        seen.append(repr(exc))
        return False
    seen.append(f"{health.status_code} {health.text[:200]} / {call.status_code} {call.text[:200]}")
    if health.status_code != 503 or call.status_code != 503:
        return False
    assert health.json()["dependencies"][dependency] == "down", health.text
    assert int(call.headers["Retry-After"]) >= 1
    error = call.json()["error"]
    assert error["code"] == "service_unavailable" and error["dependency"] == dependency, call.text
    return True


@pytest.mark.parametrize("dependency", ["postgres", "redis"])
def test_a_dependency_down_is_a_503_naming_it_and_the_server_recovers(stack: Stack, dependency: str) -> None:
    """PostgreSQL or Redis unreachable: 503 with Retry-After and the dependency's name, never a 500
    or a hang; /healthz says which; everything works again once it is back."""
    own = stack.project(f"down-{dependency}")
    variable = "DATABASE_URL" if dependency == "postgres" else "REDIS_URL"
    proxy, through = _proxied(variable, stack.env[variable])
    log = stack.logs / f"down-{dependency}.log"
    url, server = start_server(stack.env, log, **{variable: through})
    try:
        assert httpx.get(f"{url}/healthz").json()["dependencies"] == {"postgres": "up", "redis": "up"}
        proxy.cut()
        deadline = time.monotonic() + 60
        seen: list[str] = []
        while not _answers_503(url, own.api_key, dependency, seen):
            assert time.monotonic() < deadline, f"no 503 for a dependency that is down: {seen[-3:]}"
            time.sleep(0.2)
        proxy.restore()
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/healthz", timeout=15).status_code != 200:
            assert time.monotonic() < deadline, "the server did not recover"
            time.sleep(0.2)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {own.api_key}"}, timeout=30) as c:
            r = c.post("/api/v1/tasks/echo/trigger", json={"payload": 1})
            assert r.status_code == 200, r.text
            assert c.get(f"/api/v3/runs/{r.json()['id']}").status_code == 200
        text = log.read_text()  # no request failed as a server error
        assert "Exception in ASGI application" not in text and "ERROR run_engine.api" not in text, text[-3000:]
    finally:
        stop(server)
        proxy.close()
