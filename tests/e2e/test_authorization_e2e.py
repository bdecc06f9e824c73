"""The authorization matrix (issue 10): every route × every kind of credential, each cell with
its expected status (401, 403 or 404, never 200, never 500), and proof that nothing of the victim
tenant changed. A table row per route, so a new route fails the test until it is classified."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from run_engine.api import (
    auth,
    batches,
    bulk,
    bulk_actions,
    idempotency,
    packets,
    public,
    realtime_shapes,
    schedules,
    stream,
    tokens,
    uploads,
    worker,
    worker_groups,
)
from run_engine.api.public_tokens import AUDIENCE, ISSUER, sign
from run_engine.run_tokens import RunTokens

from .conftest import Stack

W = "/engine/v1/worker-actions"
SECRET = "e2e-secret-not-for-production"  # tests/e2e/conftest.py


@dataclass
class Route:
    method: str
    path: str  # as registered, {params} filled from the victim below
    body: Any = None
    # "none": a run token may not call it; "own": only for its own run (targets the victim's other
    # run here, so refused); "scoped": allowed and acting for the token's run (e.g. a child)
    run_token: str = "none"
    # the path names one of the victim's ids (a queue name is not one: every environment has its
    # own queues, so another tenant's key addresses its own queue of that name)
    targets: bool = True
    items: bool = False  # worker batch routes: per-item results
    public: bool = False  # a public access token (a JWT with scopes) is accepted
    query: str = ""
    params: dict[str, str] | None = None  # path parameters that are not the victim's ids (filled first)
    signed: bool = False  # a signed URL is the credential: without its signature, refused whatever is sent


ROUTES = [
    Route("POST", "/api/v1/tasks/batch", {"items": [{"task": "echo", "payload": 1}]}, "scoped", targets=False,
          public=True),
    Route("POST", "/api/v2/tasks/batch", {"items": [{"task": "echo", "payload": 1}]}, "scoped", targets=False,
          public=True),
    Route("POST", "/api/v1/tasks/{task_id}/trigger", {"payload": 1}, "scoped", targets=False, public=True),
    Route("GET", "/api/v1/batches/{batch_id}", run_token="own", public=True),
    Route("GET", "/api/v2/batches/{batch_id}", run_token="own", public=True),
    Route("GET", "/api/v3/runs/{run_id}", run_token="own", public=True),
    Route("POST", "/api/v1/bulk-actions", {"action": "cancel", "filter": {"tag": "x"}}, targets=False),
    Route("GET", "/api/v1/bulk-actions", targets=False),
    Route("GET", "/api/v1/bulk-actions/{bulk_id}"),
    Route("POST", "/api/v1/bulk-actions/{bulk_id}/abort"),
    Route("POST", "/api/v1/idempotencyKeys/{key:path}/reset", {"taskIdentifier": "echo"}, targets=False,
          params={"key:path": "victim-key"}),
    Route("GET", "/api/v1/runs", targets=False),
    Route("POST", "/api/v2/runs/{run_id}/cancel"),
    Route("POST", "/api/v1/runs/{run_id}/replay"),
    Route("POST", "/api/v1/runs/{run_id}/reschedule", {"delay": "1h"}),
    Route("GET", "/api/v1/runs/{run_id}/explain"),
    Route("PUT", "/api/v1/runs/{run_id}/metadata", {"metadata": {"pwned": True}}, "own"),
    Route("POST", "/api/v1/runs/{run_id}/tags", {"tags": ["pwned"]}, "own"),
    Route("GET", "/api/v1/queues", targets=False),
    Route("POST", "/api/v1/queues/{name:path}/pause", {"action": "pause"}, targets=False),
    Route("POST", "/api/v1/queues/{name:path}/concurrency/override", {"concurrencyLimit": 0}, targets=False),
    Route("POST", "/api/v1/queues/{name:path}/concurrency/reset", targets=False),
    Route("GET", "/api/v1/queues/{name:path}", targets=False),
    Route("GET", "/api/v1/dlq", targets=False),
    Route("POST", "/api/v1/dlq/redrive", {}, targets=False),
    Route("POST", "/api/v1/dlq/{run_id}/redrive"),
    Route("POST", "/api/v1/waitpoints/tokens", {}, "scoped", targets=False),
    Route("GET", "/api/v1/waitpoints/tokens", targets=False),
    Route("GET", "/api/v1/waitpoints/tokens/{waitpoint_id}", run_token="scoped"),
    Route("POST", "/api/v1/waitpoints/tokens/{waitpoint_id}/complete", {"data": "pwned"}, "scoped", public=True),
    Route("POST", "/api/v1/waitpoints/tokens/{waitpoint_id}/callback/{signature}", {"pwned": 1}),
    Route("POST", "/api/v1/schedules", {"task": "echo", "cron": "* * * * *"}, targets=False),
    Route("GET", "/api/v1/schedules", targets=False),
    Route("GET", "/api/v1/schedules/{schedule_id}"),
    Route("DELETE", "/api/v1/schedules/{schedule_id}"),
    Route("PUT", "/api/v1/schedules/{schedule_id}", {"task": "echo", "cron": "* * * * *"}),
    Route("POST", "/api/v3/batches", {"runCount": 1}, targets=False),
    Route("POST", "/api/v1/runs/bulk/cancel", {"filter": {"tag": ["nothing-has-this-tag"]}}, targets=False),
    Route("POST", "/api/v1/runs/bulk/replay", {"filter": {"tag": ["nothing-has-this-tag"]}}, targets=False),
    Route("GET", "/api/v1/runs/bulk/{bulk_id}"),
    Route("POST", "/api/v3/batches/{batch_id}/items", {"index": 0, "task": "echo", "payload": 1}),
    Route("POST", "/api/v1/schedules/{schedule_id}/activate"),
    Route("POST", "/api/v1/schedules/{schedule_id}/deactivate"),
    Route("GET", "/realtime/v1/runs/{run_id}", public=True),
    Route("GET", "/realtime/v1/runs/{run_id}", public=True, query="?offset=-1"),
    Route("GET", "/realtime/v1/runs", public=True, targets=False, query="?tags=victim&offset=-1"),
    Route("GET", "/realtime/v1/batches/{batch_id}", public=True, query="?offset=-1"),
    Route("GET", "/api/v1/runs/{run_id}/packets/{field}", public=True, params={"field": "payload"}),
    Route("GET", "/api/v1/packets/{path:path}", public=True, params={"path:path": "{run_id}/payload.json"}),
    Route("GET", "/api/v1/packet-downloads/{env_id}/{run_id}/{field}", params={"field": "payload"}, signed=True,
          query="?expires=99999999999&signature=forged"),
    Route("PUT", "/api/v2/packets/{name:path}", targets=False, public=True,
          params={"name:path": "trigger/echo/1/payload.json"}),
    Route("PUT", "/api/v1/packet-uploads/{env_id}/{path:path}", params={"path:path": "uploads/x/payload.json"},
          signed=True, query="?expires=99999999999&signature=forged"),
    Route("POST", "/api/v1/auth/jwt/claims", targets=False),
    Route("POST", "/api/v1/auth/public-tokens", {"scopes": ["admin"]}, targets=False),
    Route("GET", "/api/v1/worker-groups", targets=False),
    Route("POST", f"{W}/connect", {"workerInstanceName": "x", "deployment": {"tasks": [{"id": "echo"}]}},
          targets=False),
    Route("POST", f"{W}/heartbeat", {"workerInstanceName": "x"}, targets=False),
    Route("POST", f"{W}/dequeue", {"maxRuns": 10}, targets=False),
    Route("POST", f"{W}/attempts/start", None, targets=False, items=True),
    Route("POST", f"{W}/attempts/complete", None, targets=False, items=True),
    Route("POST", f"{W}/waits", None, targets=False, items=True),
    Route("GET", f"{W}/runs/{{run_id}}/snapshots/latest"),
    Route("POST", f"{W}/runs/{{run_id}}/snapshots/{{snapshot_id}}/attempts/start"),
    Route("POST", f"{W}/runs/{{run_id}}/snapshots/{{snapshot_id}}/attempts/complete", {"ok": True, "output": 1}),
    Route("POST", f"{W}/runs/{{run_id}}/snapshots/{{snapshot_id}}/heartbeat"),
    Route("POST", f"{W}/runs/{{run_id}}/snapshots/{{snapshot_id}}/continue"),
    Route("POST", f"{W}/runs/{{run_id}}/snapshots/{{snapshot_id}}/suspend"),
    Route("POST", f"{W}/runs/{{run_id}}/snapshots/{{snapshot_id}}/wait/duration", {"sequence": 0, "seconds": 60}),
    Route("POST", f"{W}/runs/{{run_id}}/snapshots/{{snapshot_id}}/waitpoints/{{waitpoint_id}}/wait",
          {"sequence": 0}),
    Route("POST", f"{W}/runs/{{run_id}}/snapshots/{{snapshot_id}}/trigger",
          {"sequence": 0, "items": [{"task": "echo", "payload": 1}]}),
    Route("POST", f"{W}/runs/{{run_id}}/journal", {"snapshotId": "s", "sequence": 0, "key": "k", "result": 1}),
    Route("GET", f"{W}/runs/{{run_id}}/journal"),
]


def test_every_route_is_in_the_matrix() -> None:
    modules = (public, batches, bulk, bulk_actions, tokens, schedules, stream, realtime_shapes, packets, uploads,
               idempotency, auth, worker_groups, worker)
    registered = {(m, r.path) for mod in modules for r in mod.ROUTES for m in r.methods - {"HEAD"}}
    assert registered == {(r.method, r.path) for r in ROUTES}


@dataclass
class Tenant:
    api_key: str
    token: str
    env_id: str


def _tenant(stack: Stack, project: str, env: str = "dev") -> Tenant:
    creds = json.loads(stack.cli("bootstrap", "--org", "e2e", "--project", project, "--env", env).stdout)
    t = Tenant(creds["apiKey"], creds["workerGroupToken"], creds["environmentId"])
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {t.token}"}) as w:
        assert w.post(f"{W}/connect", json={"workerInstanceName": "m", "deployment": {
            "tasks": [{"id": "echo"}, {"id": "delayed"}]}}).status_code == 200
    return t


@dataclass
class Victim:
    tenant: Tenant
    ids: dict[str, str]
    live_token: str  # run token of the run the routes target (EXECUTING)
    sibling_token: str  # run token of another executing run of the same environment
    ended_token: str  # run token of a run whose attempt completed


def _call(stack: Stack, key: str, method: str, path: str, body: Any = None) -> httpx.Response:
    return httpx.request(method, f"{stack.url}{path}", json=body, timeout=30,
                         headers={"Authorization": f"Bearer {key}"})


def _start(stack: Stack, t: Tenant, run_ids: list[str]) -> dict[str, dict[str, Any]]:
    got: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + 20
    while set(run_ids) - set(got):
        r = _call(stack, t.token, "POST", f"{W}/dequeue", {"maxRuns": 10, "waitMs": 500, "startAttempts": True})
        assert r.status_code == 200, r.text
        got.update({i["run"]["id"]: i["attempt"] for i in r.json()["runs"]})
        assert time.monotonic() < deadline
    return got


class Heartbeats:
    """Keeps the victim's executing runs alive (the e2e executing timeout is 3 s) while the
    matrix runs, so that only a refused call could change them."""

    def __init__(self, stack: Stack, t: Tenant, runs: dict[str, str]) -> None:
        import threading

        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, args=(stack, t, runs), daemon=True)
        self.thread.start()

    def _beat(self, stack: Stack, t: Tenant, runs: dict[str, str]) -> None:
        with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {t.token}"}) as w:
            while not self.stop.wait(0.3):
                for run_id, snapshot_id in runs.items():
                    w.post(f"{W}/runs/{run_id}/snapshots/{snapshot_id}/heartbeat")


@pytest.fixture(scope="module")
def victim(stack: Stack) -> Iterator[Victim]:
    t = _tenant(stack, "matrix-victim")
    trig = [_call(stack, t.api_key, "POST", "/api/v1/tasks/echo/trigger", {"payload": i}).json()["id"]
            for i in range(3)]
    started = _start(stack, t, trig)
    target, sibling, ended = trig
    early = Heartbeats(stack, t, {r: started[r]["snapshot"]["id"] for r in (target, sibling)})
    done = _call(stack, t.token, "POST", f"{W}/runs/{ended}/snapshots/{started[ended]['snapshot']['id']}"
                                         "/attempts/complete", {"ok": True, "output": "done"})
    assert done.status_code == 200, done.text
    batch = _call(stack, t.api_key, "POST", "/api/v1/tasks/batch", {"items": [
        {"task": "delayed", "payload": 1, "options": {"delay": "1h"}}]}).json()["id"]
    token = _call(stack, t.api_key, "POST", "/api/v1/waitpoints/tokens", {}).json()["id"]
    other_token = _call(stack, t.api_key, "POST", "/api/v1/waitpoints/tokens", {}).json()["id"]
    schedule = _call(stack, t.api_key, "POST", "/api/v1/schedules",
                     {"task": "delayed", "cron": "0 0 1 1 *"}).json()["id"]
    bulk_id = _call(stack, t.api_key, "POST", "/api/v1/runs/bulk/cancel",
                    {"filter": {"tag": ["nothing-has-this-tag"]}}).json()["id"]
    ids = {"run_id": target, "snapshot_id": started[target]["snapshot"]["id"], "batch_id": batch, "bulk_id": bulk_id,
           "waitpoint_id": token, "schedule_id": schedule, "name:path": "task/echo", "task_id": "echo",
           "signature": RunTokens(SECRET).callback_signature(other_token),
           "queue_id": _call(stack, t.api_key, "GET", "/api/v1/queues/task/echo").json()["id"]}
    beats = early
    yield Victim(t, ids, started[target]["runToken"], started[sibling]["runToken"], started[ended]["runToken"])
    beats.stop.set()
    beats.thread.join()


def _fingerprint(stack: Stack, v: Victim) -> dict[str, Any]:
    key = v.tenant.api_key
    runs = _call(stack, key, "GET", "/api/v1/runs", None).json()["data"]
    return {
        "runs": sorted((r["id"], r["status"], r["attemptCount"], tuple(r["tags"]), json.dumps(r["metadata"]),
                        r.get("delayedUntil")) for r in runs),
        "queues": sorted((q["name"], q["paused"], q["concurrencyLimit"])
                         for q in _call(stack, key, "GET", "/api/v1/queues").json()["data"]),
        "schedules": sorted((s["id"], s["active"])
                            for s in _call(stack, key, "GET", "/api/v1/schedules").json()["data"]),
        "token": _call(stack, key, "GET", f"/api/v1/waitpoints/tokens/{v.ids['waitpoint_id']}").json()["status"],
        "snapshot": _call(stack, v.tenant.token, "GET", f"{W}/runs/{v.ids['run_id']}/snapshots/latest").json(),
    }


def _path(route: Route, ids: dict[str, str]) -> str:
    path = route.path
    for name, value in (route.params or {}).items():
        path = path.replace("{" + name + "}", value)
    for name, value in ids.items():
        path = path.replace("{" + name + "}", value)
    return path + route.query


def _public_token(env_id: str, key: str) -> str:
    now = int(time.time())
    return sign(key, {"sub": env_id, "pub": True, "iss": ISSUER, "aud": AUDIENCE, "iat": now, "exp": now + 600,
                      "scopes": ["admin"]})


def _body(route: Route, v: Victim) -> Any:
    if route.items and route.path.endswith("/start"):
        return {"items": [{"runId": v.ids["run_id"], "snapshotId": v.ids["snapshot_id"]}]}
    if route.items and route.path.endswith("/waits"):
        return {"items": [{"runId": v.ids["run_id"], "snapshotId": v.ids["snapshot_id"],
                           "waitpointId": v.ids["waitpoint_id"], "sequence": 0}]}
    if route.items:
        return {"items": [{"runId": v.ids["run_id"], "snapshotId": v.ids["snapshot_id"], "ok": True, "output": 1}]}
    return route.body


def test_the_matrix(stack: Stack, victim: Victim) -> None:
    v = victim
    other_env = _tenant(stack, "matrix-victim", "prod")  # same project, another environment
    other_project = _tenant(stack, "matrix-attacker")
    expired = RunTokens(SECRET).mint(v.ids["run_id"], 1, int(time.time()) - 5)
    forged = v.live_token[:-4] + ("AAAA" if not v.live_token.endswith("AAAA") else "BBBB")
    before = _fingerprint(stack, v)

    credentials: dict[str, str | None] = {
        "none": None, "malformed": "Basic dXNlcjpwYXNz", "unknown key": "tr_dev_" + "x" * 32,
        "another environment's key": other_env.api_key, "another project's key": other_project.api_key,
        "the victim's worker token": v.tenant.token, "the victim's API key": v.tenant.api_key,
        "another group's worker token": other_project.token, "a run token of another run": v.sibling_token,
        "an expired run token": expired, "a forged run token": forged, "an ended attempt's run token": v.ended_token,
        "the run's own token": v.live_token,
        # public access tokens (JWTs): one forged for the victim's environment, one of another environment
        "a forged public token": _public_token(v.tenant.env_id, "tr_dev_not-the-key"),
        "another environment's public token": _public_token(other_env.env_id, other_env.api_key),
    }
    failures: list[str] = []
    cells = 0
    http = httpx.Client(base_url=stack.url, timeout=30)
    for route in ROUTES:
        is_worker = route.path.startswith(W)
        is_callback = "callback" in route.path
        for name, key in credentials.items():
            expected = _expected(route, name, is_worker, is_callback)
            if expected is None:
                continue
            headers = {} if key is None else {"Authorization": key if name == "malformed" else f"Bearer {key}"}
            r = http.request(route.method, _path(route, {**v.ids, "env_id": v.tenant.env_id}),
                             json=_body(route, v), headers=headers)
            cells += 1
            got = r.status_code
            if expected == "items-404":
                ok = got == 200 and [i["status"] for i in r.json()["results"]] == [404]
            elif expected == "no-leak":
                ok = got == 200 and not any(x in r.text for x in (v.ids["run_id"], v.ids["waitpoint_id"],
                                                                   v.ids["schedule_id"], v.ids["queue_id"]))
            else:
                ok = got == expected and r.json()["error"]["code"] in ("unauthorized", "forbidden", "not_found")
            if not ok:
                failures.append(f"{route.method} {route.path} with {name}: expected {expected}, got {got} "
                                f"{r.text[:160]}")
    http.close()
    assert not failures, "\n".join(failures)
    assert cells > 400
    assert _fingerprint(stack, v) == before  # nothing of the victim changed


def _expected(route: Route, cred: str, is_worker: bool, is_callback: bool) -> int | str | None:
    """The status a cell must answer with; None: the cell does not apply (the credential acts on
    its own tenant there, as it may)."""
    if route.signed:  # a URL whose signature is the credential, here a forged one: whatever else is sent
        return 403
    if is_callback:  # the signature in the path is the credential: another token's is refused
        return 401 if cred == "none" else None
    if cred in ("none", "malformed", "unknown key", "an expired run token", "a forged run token",
                "a forged public token"):
        return 401
    if cred == "another environment's public token":  # valid, with every scope, of its own environment
        if is_worker:
            return 401  # not a worker token at all
        if not route.public:
            return 403
        return 404 if route.targets else None
    if cred == "an ended attempt's run token":  # genuine: of the wrong kind, or no longer live
        return 403 if is_worker or route.run_token == "none" else 401
    run_token = cred in ("a run token of another run", "the run's own token")
    if is_worker:
        if cred in ("the victim's API key", "another environment's key", "another project's key") or run_token:
            return 403
        if cred == "another group's worker token":
            if route.items:
                return "items-404"
            if not route.targets:
                return "no-leak" if route.path.endswith("/dequeue") else None
            return 404
        return None  # the victim's own worker token
    if cred in ("the victim's worker token", "another group's worker token"):
        return 403
    if cred in ("another environment's key", "another project's key"):
        if not route.targets:
            return "no-leak" if route.method == "GET" else None
        return 404
    if cred == "the victim's API key":
        return None
    # run tokens on the public API
    if route.run_token == "none":
        return 403
    if route.run_token == "own":
        if cred == "the run's own token":
            return None  # its own run, or (batch) not its children: below
        return 403
    return None  # scoped: acts for the token's own run


def test_a_run_token_acts_for_its_own_run_only(stack: Stack, victim: Victim) -> None:
    v, key = victim, victim.live_token
    run_id = v.ids["run_id"]
    assert _call(stack, key, "GET", f"/api/v3/runs/{run_id}").status_code == 200
    assert _call(stack, key, "PUT", f"/api/v1/runs/{run_id}/metadata", {"metadata": {"mine": 1}}).status_code == 200
    child = _call(stack, key, "POST", "/api/v1/tasks/echo/trigger", {"payload": "child"})
    assert child.status_code == 200, child.text
    got = _call(stack, key, "GET", f"/api/v3/runs/{child.json()['id']}").json()
    assert got["relatedRuns"]["parent"] == run_id and got["depth"] == 1
    batch = _call(stack, key, "POST", "/api/v1/tasks/batch", {"items": [{"task": "echo", "payload": 1}]}).json()
    assert _call(stack, key, "GET", f"/api/v1/batches/{batch['id']}").status_code == 200
    assert _call(stack, key, "GET", f"/api/v1/batches/{v.ids['batch_id']}").status_code == 403  # not its children
    assert _call(stack, key, "GET", f"/api/v2/batches/{batch['id']}").status_code == 200
    assert _call(stack, key, "GET", f"/api/v2/batches/{v.ids['batch_id']}").status_code == 403
    other = _call(stack, key, "POST", "/api/v1/tasks/echo/trigger", {"payload": 1, "options": {
        "parentRunId": v.ids["run_id"].replace("run_", "run_x")}})
    assert other.status_code == 403
    token = _call(stack, key, "POST", "/api/v1/waitpoints/tokens", {}).json()["id"]
    assert _call(stack, key, "POST", f"/api/v1/waitpoints/tokens/{token}/complete", {"data": 1}).status_code == 200
    _call(stack, v.tenant.api_key, "PUT", f"/api/v1/runs/{run_id}/metadata", {"metadata": {}})
