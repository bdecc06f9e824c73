"""Hostile input over HTTP (issue 10): every value a client can send is answered with a
documented 4xx naming the field, never a 500, and nothing is written; one tenant's bad values
never fail another tenant's requests sent at the same moment."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from .conftest import Stack

W = "/engine/v1/worker-actions"
NUL = "\u0000"


@pytest.fixture(scope="module")
def hostile(stack: Stack) -> Stack:
    """A project no supervisor serves, with one deployed task."""
    own = stack.project("hostile")
    with own.worker() as w:
        r = w.post(f"{W}/connect", json={"workerInstanceName": "hand", "deployment": {"tasks": [{"id": "t"}]}})
    assert r.status_code == 200, r.text
    return own


def _runs(s: Stack) -> int:
    with s.client() as c:
        r = c.get("/api/v1/runs", params={"page[size]": "100"})
    assert r.status_code == 200, r.text
    return len(r.json()["data"])


def deep(n: int) -> Any:
    value: Any = 1
    for _ in range(n):
        value = [value]
    return value


def _trigger(options: dict[str, Any] | None = None, payload: Any = 1) -> dict[str, Any]:
    return {"payload": payload, **({"options": options} if options is not None else {})}


# (method, path, json body, expected status, field the message starts with)
BAD_BODIES: list[tuple[str, str, Any, int, str]] = [
    ("POST", "/api/v1/tasks/t/trigger", _trigger(payload={"a": f"x{NUL}y"}), 400, "payload.a"),
    ("POST", "/api/v1/tasks/t/trigger", _trigger(payload={NUL: 1}), 400, "payload"),
    ("POST", "/api/v1/tasks/t/trigger", _trigger({"tags": [f"a{NUL}"]}), 400, "options.tags"),
    ("POST", "/api/v1/tasks/t/trigger", _trigger({"concurrencyKey": NUL}), 400, "options.concurrencyKey"),
    ("POST", "/api/v1/tasks/t/trigger", _trigger({"idempotencyKey": NUL}), 400, "options.idempotencyKey"),
    ("POST", "/api/v1/tasks/t/trigger", _trigger({"metadata": {NUL: 1}}), 400, "options.metadata"),
    ("POST", "/api/v1/tasks/t/trigger", _trigger({"queue": f"q{NUL}"}), 400, "options.queue"),
    ("POST", "/api/v1/tasks/t/trigger", _trigger({"priority": 1e308}), 400, "options.priority"),
    ("POST", "/api/v1/tasks/t/trigger", _trigger({"priority": 1e10}), 400, "options.priority"),
    ("POST", "/api/v1/tasks/t/trigger", _trigger({"ttl": 1e10}), 400, "options.ttl"),
    ("POST", "/api/v1/tasks/t/trigger", _trigger({"maxDuration": 1e10}), 400, "options.maxDuration"),
    ("POST", "/api/v1/tasks/t/trigger", _trigger({"delay": 1e20}), 400, "options.delay"),
    ("POST", "/api/v1/tasks/t/trigger", _trigger({"delay": -5}), 400, "options.delay"),
    ("POST", "/api/v1/tasks/t/trigger", _trigger({"idempotencyKeyTTL": 1e20}), 400, "options.idempotencyKeyTTL"),
    ("POST", "/api/v1/tasks/t/trigger", _trigger({"delay": "9999-12-31T23:00:00-20:00"}), 400, "options.delay"),
    ("POST", "/api/v1/tasks/t/trigger", _trigger({"retry": {"minTimeoutInMs": 10**20}}), 400, "options.retry"),
    ("POST", "/api/v1/tasks/t/trigger", _trigger({"retry": {"minTimeoutInMs": 5000, "maxTimeoutInMs": 10}}), 400,
     "options.retry"),
    ("POST", "/api/v1/tasks/t/trigger", _trigger(payload=deep(300)), 400, "payload"),
    ("POST", "/api/v1/tasks/t/trigger", _trigger({"payloadType": "application/json"}, payload='{"a": "\\u0000"}'),
     400, "payload.a"),
    ("POST", "/api/v1/tasks/t/trigger", _trigger({"payloadType": "application/json"}, payload=str(deep(300))), 400,
     "payload"),
    ("POST", "/api/v1/tasks/batch", {"items": [{"task": "t", "payload": 1}, {"task": "t", "payload": NUL}]}, 400,
     "items.1.payload"),
    ("POST", "/api/v1/tasks/batch", {"items": [{"task": f"t{NUL}", "payload": 1}]}, 400, "items.0.task"),
    ("POST", "/api/v1/waitpoints/tokens", {"timeout": 1e20}, 400, "timeout"),
    ("POST", "/api/v1/waitpoints/tokens", {"idempotencyKeyTTL": 1e20}, 400, "idempotencyKeyTTL"),
    ("POST", "/api/v1/waitpoints/tokens", {"tags": [NUL]}, 400, "tags"),
    ("POST", "/api/v1/waitpoints/tokens", {"idempotencyKey": NUL}, 400, "idempotencyKey"),
    ("POST", "/api/v1/schedules", {"task": "t", "cron": "* * * * *", "externalId": NUL}, 400, "externalId"),
    ("POST", "/api/v1/schedules", {"task": NUL, "cron": "* * * * *"}, 400, "task"),
    ("POST", "/api/v1/schedules", {"task": "t", "cron": "* * * * *", "timezone": NUL}, 400, "timezone"),
    ("POST", "/api/v1/dlq/redrive", {"taskIdentifier": NUL}, 400, "taskIdentifier"),
    # a key past what a unique index entry holds (~2.7 kB)
    ("POST", "/api/v3/batches", {"runCount": 1, "idempotencyKey": "é" * 2000}, 400, "idempotencyKey"),
]


@pytest.mark.parametrize(("method", "path", "payload", "status", "field"), BAD_BODIES)
def test_bad_values_are_4xx_naming_the_field_and_write_nothing(hostile: Stack, method: str, path: str,
                                                                payload: Any, status: int, field: str) -> None:
    before = _runs(hostile)
    with hostile.client() as c:
        r = c.request(method, path, json=payload)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"].startswith(field), r.text
    assert _runs(hostile) == before


def test_values_at_the_edges_of_the_ranges_are_accepted(hostile: Stack) -> None:
    with hostile.client() as c:
        for options, payload in (({"priority": 2_147_484}, 1), ({"ttl": "3650d"}, 1), ({"delay": "1d"}, deep(99)),
                                 ({"maxDuration": 315_360_000}, {"k": "\\u0000 is text here"})):
            r = c.post("/api/v1/tasks/t/trigger", json=_trigger(options, payload))
            assert r.status_code == 200, (options, r.text)
            run = c.get(f"/api/v3/runs/{r.json()['id']}").json()
            assert run["payload"] == payload
        # an offset PostgreSQL would refuse (found by fuzzing): taken, and stored in UTC
        r = c.post("/api/v1/tasks/t/trigger", json=_trigger({"delay": "2999-12-17T04:23:59-20:33"}))
        assert r.status_code == 200, r.text
        assert c.get(f"/api/v3/runs/{r.json()['id']}").json()["delayedUntil"].startswith("2999-12-18T00:56:59")
        token = c.post("/api/v1/waitpoints/tokens", json={"timeout": "2999-01-01T00:00:00Z"})
        assert token.status_code == 200, token.text
        got = c.get(f"/api/v1/waitpoints/tokens/{token.json()['id']}").json()
        assert got["timeoutAt"].startswith("2999-01-01")


BAD_REQUESTS: list[tuple[str, str, int]] = [
    ("GET", "/api/v3/runs/%00", 400),
    ("GET", "/api/v3/runs/%ff%fe", 400),
    ("GET", "/api/v3/runs/run_" + "a" * 5000, 404),
    ("GET", "/api/v3/runs/" + "é" * 40, 404),
    ("GET", "/api/v1/runs?filter[tag]=%00", 400),
    ("GET", "/api/v1/runs?filter[queue]=a%00b", 400),
    ("GET", "/api/v1/runs?filter[taskIdentifier]=" + ",".join(["x"] * 500), 400),
    ("GET", "/api/v1/runs?page[after]=%00", 400),
    ("GET", "/api/v1/runs?page[after]=notacursor", 400),
    ("GET", "/api/v1/runs?page[size]=100000000000000000000", 400),
    ("GET", "/api/v1/waitpoints/tokens?filter[tags]=%00", 400),
    ("GET", "/api/v1/waitpoints/tokens?page[after]=%00", 400),
    ("GET", "/api/v1/schedules?page[after]=x|%00", 400),
    ("GET", "/api/v1/waitpoints/tokens/%00", 400),
    ("GET", "/api/v1/schedules/%00", 400),
    ("GET", "/api/v1/batches/%00", 400),
    ("GET", "/api/v1/queues/%00", 400),
    ("POST", "/api/v1/tasks/%00/trigger", 400),
    ("POST", "/api/v1/tasks/" + "x" * 200 + "/trigger", 400),
    ("GET", "/api/v1/runs/run_x/explain", 404),
    ("GET", "/realtime/v1/runs/%00", 400),
    # digits that str.isdigit takes and int refuses ("²"), and an offset past any date
    ("GET", "/api/v1/runs?page[size]=%C2%B2", 400),
    ("GET", "/api/v1/waitpoints/tokens?page[size]=%C2%B2", 400),
    ("GET", "/api/v1/queues?page=%C2%B2", 400),
    ("GET", "/realtime/v1/runs?tags=a&offset=%C2%B2_0&live=true", 400),
    ("GET", "/realtime/v1/runs?tags=a&offset=99999999999999999999_0&live=true", 400),
]


@pytest.mark.parametrize(("method", "path", "status"), BAD_REQUESTS)
def test_bad_paths_and_queries_are_4xx(hostile: Stack, method: str, path: str, status: int) -> None:
    with hostile.client() as c:
        r = c.request(method, path, json={"payload": 1} if method == "POST" else None)
    assert r.status_code == status, (path, r.text)
    assert set(r.json()["error"]) >= {"code", "message"}


def test_hostile_credentials_and_signatures_are_401(hostile: Stack) -> None:
    token = httpx.post(f"{hostile.url}/api/v1/waitpoints/tokens", json={},
                       headers={"Authorization": f"Bearer {hostile.api_key}"}).json()["id"]
    for path, headers in ((f"/api/v1/waitpoints/tokens/{token}/callback/%C3%A9t%C3%A9", {}),
                          ("/api/v1/runs", {"Authorization": "Bearer rt_run_x.1.99999999999.\u00e9t\u00e9"}),
                          ("/api/v1/runs", {"Authorization": "Bearer rt_%00"}),
                          ("/api/v1/runs", {"Authorization": "Bearer " + "k" * 4000})):
        r = httpx.post(f"{hostile.url}{path}", json=1, headers=headers) if "callback" in path else \
            httpx.get(f"{hostile.url}{path}", headers={k: v.encode() for k, v in headers.items()})
        assert r.status_code == 401, (path, r.text)


def test_huge_header_values_are_431_not_held_in_memory(hostile: Stack) -> None:
    auth = {"Authorization": f"Bearer {hostile.api_key}"}
    assert httpx.get(f"{hostile.url}/api/v1/runs", headers={**auth, "X-Fine": "v" * 20_000}).status_code == 200
    for size in (100_000, 5_000_000):
        try:
            r = httpx.get(f"{hostile.url}/api/v1/runs", headers={**auth, "X-Big": "v" * size})
        except (httpx.RemoteProtocolError, httpx.WriteError):
            continue  # the server answered and closed before the client finished sending
        assert r.status_code == 431, r.status_code
        assert r.json()["error"]["code"] == "request_header_too_large"
    assert httpx.get(f"{hostile.url}/healthz").status_code == 200


def test_a_header_that_never_ends_is_431_once_past_the_limit(hostile: Stack) -> None:
    """httptools reports a header only when it ends, and grows an unfinished one quadratically: a
    client that never ends its header held the event loop (every tenant's requests) for seconds."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(hostile.url)
    with socket.create_connection((url.hostname, url.port), timeout=20) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        answer = b""
        try:
            for _ in range(200):  # up to 12.8 MB, 64 kB at a time, never a line end
                sock.sendall(b"a" * 65_536)
        except OSError:
            pass  # answered and closed while we were still sending
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(65_536)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert httpx.get(f"{hostile.url}/healthz").status_code == 200


# --- the worker API --------------------------------------------------------------------------

def _dequeue(s: Stack, *run_ids: str) -> dict[str, dict[str, Any]]:
    """Dequeue and start ``run_ids`` by hand; other runs of the project are completed."""
    wanted: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + 20
    with s.worker() as w:
        while set(wanted) != set(run_ids):
            r = w.post(f"{W}/dequeue", json={"maxRuns": 10, "waitMs": 500, "startAttempts": True})
            assert r.status_code == 200, r.text
            for item in r.json()["runs"]:
                a = item["attempt"]
                if item["run"]["id"] in run_ids:
                    wanted[item["run"]["id"]] = a
                elif a.get("ok"):
                    w.post(f"{W}/runs/{a['run']['id']}/snapshots/{a['snapshot']['id']}/attempts/complete",
                           json={"ok": True, "output": None})
            assert time.monotonic() < deadline
    return wanted


def test_an_unstorable_output_fails_only_its_own_run(hostile: Stack) -> None:
    bad, good = hostile.trigger("t", "bad"), hostile.trigger("t", "good")
    started = _dequeue(hostile, bad, good)
    a, b = started[bad], started[good]
    with hostile.worker() as w:
        r = w.post(f"{W}/attempts/complete", json={"items": [
            {"runId": bad, "snapshotId": a["snapshot"]["id"], "ok": True, "output": {"x": NUL}},
            {"runId": good, "snapshotId": b["snapshot"]["id"], "ok": True, "output": {"y": 1}}]})
    assert r.status_code == 200, r.text
    assert [x["ok"] for x in r.json()["results"]] == [True, True]
    failed, done = hostile.run(bad), hostile.run(good)
    assert failed["status"] == "FAILED" and failed["error"]["type"] == "OUTPUT_NOT_STORABLE"
    assert "items.0.output.x" in failed["error"]["message"]
    assert done["status"] == "COMPLETED" and done["output"] == {"y": 1}


def test_an_error_with_nul_is_stored_readably(hostile: Stack) -> None:
    run_id = hostile.trigger("t", "err", maxAttempts=1)
    a = _dequeue(hostile, run_id)[run_id]
    with hostile.worker() as w:
        r = w.post(f"{W}/runs/{run_id}/snapshots/{a['snapshot']['id']}/attempts/complete",
                   json={"ok": False, "error": {"message": f"bad{NUL}byte", "stackTrace": NUL}})
    assert r.status_code == 200, r.text
    assert hostile.run(run_id)["error"]["message"] == "bad\ufffdbyte"


def test_a_huge_error_is_cut_when_stored(hostile: Stack) -> None:
    """A task that fails with megabytes of message and stack: the run fails, its error kept to
    32 Ki characters each (every page and realtime answer reads it), the name to 256."""
    run_id = hostile.trigger("t", "huge-err", maxAttempts=1)
    a = _dequeue(hostile, run_id)[run_id]
    with hostile.worker() as w:
        r = w.post(f"{W}/runs/{run_id}/snapshots/{a['snapshot']['id']}/attempts/complete",
                   json={"ok": False, "error": {"name": "N" * 5000, "message": "m" * 3_000_000,
                                                "stackTrace": "at x\n" * 500_000}})
    assert r.status_code == 200, r.text
    error = hostile.run(run_id)["error"]
    assert error["message"].startswith("m" * 32 * 1024) and len(error["message"]) < 33 * 1024
    assert "cut: 2967232 more characters" in error["message"]
    assert len(error["stackTrace"]) < 33 * 1024 and len(error["name"]) < 300


def test_an_unstorable_output_under_huge_keys_fails_with_an_error_cut_short(hostile: Stack) -> None:
    """The error names the path to the bad value, and a path of megabyte keys is cut like any error."""
    run_id = hostile.trigger("t", "deep-key", maxAttempts=1)
    a = _dequeue(hostile, run_id)[run_id]
    with hostile.worker() as w:
        r = w.post(f"{W}/runs/{run_id}/snapshots/{a['snapshot']['id']}/attempts/complete",
                   json={"ok": True, "output": {"k" * 1_000_000: {"q" * 1_000_000: {"x": NUL}}}})
    assert r.status_code == 200, r.text
    error = hostile.run(run_id)["error"]
    assert error["type"] == "OUTPUT_NOT_STORABLE" and len(error["message"]) < 33 * 1024
    assert error["message"].startswith("the task's output.kkk") and "[cut:" in error["message"]


def test_worker_bodies_with_unstorable_values_are_400(hostile: Stack) -> None:
    run_id = hostile.trigger("t", "journal")
    a = _dequeue(hostile, run_id)[run_id]
    with hostile.worker() as w:
        for path, payload, field in (
            (f"{W}/runs/{run_id}/journal", {"snapshotId": a["snapshot"]["id"], "sequence": 0, "key": "k",
                                            "result": {"r": NUL}}, "result.r"),
            (f"{W}/runs/{run_id}/journal", {"snapshotId": a["snapshot"]["id"], "sequence": 0, "key": NUL}, "key"),
            (f"{W}/connect", {"workerInstanceName": "x", "deployment": {"tasks": [{"id": f"a{NUL}"}]}},
             "deployment.tasks.0.id"),
            (f"{W}/connect", {"workerInstanceName": "x", "deployment": {"tasks": [{"id": "a"}],
                                                                          "queues": [{"name": NUL}]}},
             "deployment.queues.0.name"),
            (f"{W}/dequeue", {"maxRuns": 1, "waitMs": 1e20}, "waitMs"),
            # found by fuzzing: a 64-bit max duration overflowed its column (500)
            (f"{W}/connect", {"workerInstanceName": "x", "deployment": {"tasks": [
                {"id": "a", "maxDuration": 103992698917878976}]}}, "deployment.tasks.0.maxDuration"),
            (f"{W}/connect", {"workerInstanceName": "x", "deployment": {"tasks": [{"id": "a"}], "queues": [
                {"name": "0"}, {"name": "0"}]}}, "deployment.queues"),
            (f"{W}/connect", {"workerInstanceName": "x", "deployment": {"tasks": [
                {"id": "a", "retry": {"factor": "fast"}}]}}, "deployment.tasks.0.retry"),
            (f"{W}/connect", {"workerInstanceName": "x", "deployment": {"tasks": [
                {"id": "a", "retry": {"min_timeout": 30, "max_timeout": 5}}]}}, "deployment.tasks.0.retry"),
            (f"{W}/heartbeat", {"workerInstanceName": NUL}, "workerInstanceName"),
        ):
            r = w.post(path, json=payload)
            assert r.status_code == 400, (path, r.text)
            assert r.json()["error"]["message"].startswith(field), r.text
        # found by fuzzing: a version deployed again with other tasks was a unique violation (500)
        first = w.post(f"{W}/connect", json={"workerInstanceName": "v", "deployment": {
            "tasks": [{"id": "t"}, {"id": "v1-only"}], "version": "fixed"}})
        assert first.status_code == 200, first.text
        clash = w.post(f"{W}/connect", json={"workerInstanceName": "v", "deployment": {
            "tasks": [{"id": "t"}, {"id": "v2-only"}], "version": "fixed"}})
        assert clash.status_code == 409 and clash.json()["error"]["message"].startswith("deployment.version")
        cron = w.post(f"{W}/connect", json={"workerInstanceName": "v", "deployment": {
            "tasks": [{"id": "t"}, {"id": "c", "cron": {"pattern": "bad"}}]}})
        assert cron.status_code == 400, cron.text
        w.post(f"{W}/connect", json={"workerInstanceName": "hand", "deployment": {"tasks": [{"id": "t"}]}})
        done = w.post(f"{W}/runs/{run_id}/snapshots/{a['snapshot']['id']}/attempts/complete",
                      json={"ok": True, "output": 1})
        assert done.status_code == 200


# --- one tenant's bad input beside another's good input -------------------------------------------

def test_bad_triggers_never_fail_another_tenants_triggers(stack: Stack, hostile: Stack) -> None:
    victim = stack.project("victim")
    with victim.worker() as w:
        assert w.post(f"{W}/connect", json={"workerInstanceName": "v", "deployment": {
            "tasks": [{"id": "v"}]}}).status_code == 200

    async def scenario() -> tuple[list[int], list[int]]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
            bad_h = {"Authorization": f"Bearer {hostile.api_key}"}
            good_h = {"Authorization": f"Bearer {victim.api_key}"}
            bad: list[int] = []
            good: list[int] = []
            for _ in range(10):
                calls = [client.post("/api/v1/tasks/t/trigger", headers=bad_h, json=_trigger(payload=NUL))
                         for _ in range(3)]
                calls += [client.post("/api/v1/tasks/v/trigger", headers=good_h, json=_trigger(payload=i))
                          for i in range(20)]
                answers = await asyncio.gather(*calls)
                bad += [a.status_code for a in answers[:3]]
                good += [a.status_code for a in answers[3:]]
            return bad, good

    bad, good = asyncio.run(scenario())
    assert set(bad) == {400}
    assert good == [200] * 200


def test_task_ids_and_keys_that_look_like_key_parts_never_stop_a_worker_group(stack: Stack) -> None:
    dev = stack.project("keyparts")
    creds = stack.cli("bootstrap", "--org", "e2e", "--project", "keyparts", "--env", "prod")
    import json

    prod_key = json.loads(creds.stdout)["apiKey"]
    with dev.worker() as w:
        r = w.post(f"{W}/connect", json={"workerInstanceName": "k", "deployment": {
            "tasks": [{"id": "a:k:y"}, {"id": "a"}, {"id": "k:y:vt"}]}})
        assert r.status_code == 200, r.text
    first = dev.trigger("a:k:y", 1)
    assert set(_dequeue(dev, first)) == {first}  # its queue's virtual clock now exists
    runs = [dev.trigger("a", 2, concurrencyKey="y:vt"), dev.trigger("a:k:y", 3), dev.trigger("k:y:vt", 4),
            dev.trigger("a", 5, concurrencyKey="%3A:vt")]
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {prod_key}"}) as prod:
        r = prod.post("/api/v1/tasks/a/trigger", json={"payload": "prod"})
        assert r.status_code == 200, r.text
        runs.append(r.json()["id"])
    started = _dequeue(dev, *runs)  # the prod run too: the group serves both environments
    assert set(started) == set(runs)
    with dev.client() as c:
        queues = {q["name"] for q in c.get("/api/v1/queues").json()["data"]}
    assert {"task/a:k:y", "task/a", "task/k:y:vt"} <= queues


def test_bodies_that_are_not_utf8_or_hold_lone_surrogates_are_400(hostile: Stack) -> None:
    with hostile.client() as c:
        for raw in (b'{"payload": "\\ud800"}', b'{"payload": "\xff\xfe"}',
                    b'{"payload": 1, "options": {"tags": ["\\udfff"]}}',
                    b"\xef\xbb\xbf" + b'{"payload": 1}'):
            r = c.post("/api/v1/tasks/t/trigger", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_input", (raw, r.text)


def test_a_batch_of_waits_answers_each_run_on_its_own(hostile: Stack) -> None:
    """``POST /waits``: a stale snapshot, an unknown waitpoint and another run's waitpoint id in
    one request fail alone; the good wait blocks (and suspends) as the single call would."""
    good, stale, unknown = (hostile.trigger("t", name) for name in ("w-good", "w-stale", "w-unknown"))
    started = _dequeue(hostile, good, stale, unknown)
    with hostile.client() as c:
        token = c.post("/api/v1/waitpoints/tokens", json={}).json()["id"]
    with hostile.worker() as w:
        r = w.post(f"{W}/waits", json={"items": [
            {"runId": good, "snapshotId": started[good]["snapshot"]["id"], "waitpointId": token, "sequence": 0,
             "suspend": True},
            {"runId": stale, "snapshotId": "snapshot_stale", "waitpointId": token, "sequence": 0},
            {"runId": unknown, "snapshotId": started[unknown]["snapshot"]["id"], "waitpointId": "waitpoint_nope",
             "sequence": 0},
            {"runId": "run_nope", "snapshotId": "snapshot_x", "waitpointId": token, "sequence": 0}]})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["ok"] for x in results] == [True, False, False, False], results
        assert results[0]["blocked"] and results[0]["suspended"] and results[0]["waitpointId"] == token
        assert results[0]["snapshot"]["executionStatus"] == "SUSPENDED"
        assert [x["status"] for x in results[1:]] == [409, 404, 404], results
        bad = w.post(f"{W}/waits", json={"items": [{"runId": good, "snapshotId": "s", "waitpointId": token}]})
        assert bad.status_code == 400 and "sequence" in bad.text  # the body is validated as a whole
    assert hostile.run(good)["status"] == "WAITING"
    assert hostile.run(stale)["status"] == "EXECUTING"


def test_a_malformed_snapshot_id_in_a_completion_fails_only_its_own_item(hostile: Stack) -> None:
    """The completions' body is not scanned for NUL (an output with one fails its run instead): a
    snapshot id with NUL must still never reach the statement the other items share."""
    bad, good = hostile.trigger("t", "bad-snapshot"), hostile.trigger("t", "good-snapshot")
    started = _dequeue(hostile, bad, good)
    b = started[good]
    with hostile.worker() as w:
        r = w.post(f"{W}/attempts/complete", json={"items": [
            {"runId": bad, "snapshotId": f"snapshot_{NUL}x", "ok": True, "output": 1},
            {"runId": good, "snapshotId": b["snapshot"]["id"], "ok": True, "output": {"y": 2}}]})
    assert r.status_code == 200, r.text
    first, second = r.json()["results"]
    assert first["ok"] is False and first["status"] == 409, first  # as any snapshot but the latest
    assert first["error"]["latestSnapshot"]["id"] == started[bad]["snapshot"]["id"]
    assert second["ok"] is True
    assert hostile.run(good)["status"] == "COMPLETED" and hostile.run(bad)["status"] == "EXECUTING"


def test_a_run_named_twice_in_one_batch_of_waits_waits_once(hostile: Stack) -> None:
    run_id = hostile.trigger("t", "w-twice")
    started = _dequeue(hostile, run_id)[run_id]
    with hostile.client() as c:
        token = c.post("/api/v1/waitpoints/tokens", json={}).json()["id"]
    item = {"runId": run_id, "snapshotId": started["snapshot"]["id"], "waitpointId": token, "sequence": 0}
    with hostile.worker() as w:
        r = w.post(f"{W}/waits", json={"items": [item] + [{**item, "sequence": i} for i in range(1, 50)]})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert results[0]["ok"] and results[0]["blocked"] and results[0]["waitpointId"] == token
        assert all(x["status"] == 409 and "more than once" in x["error"]["message"] for x in results[1:]), results
        journal = w.get(f"{W}/runs/{run_id}/journal").json()["journal"]
    assert [e["sequence"] for e in journal] == [0]  # the repeats wrote nothing


def test_a_tag_shape_of_any_tag_answers(hostile: Stack) -> None:
    """The shape's handle is a header: tags outside Latin-1 (or with a newline) must not reach it."""
    with hostile.client() as c:
        for tags in ("中,🙂", "a\nb"):
            r = c.get("/realtime/v1/runs", params={"tags": tags, "offset": "-1"})
            assert r.status_code == 200, r.text
            assert r.headers["electric-handle"].isascii() and r.json()[-1]["headers"]["control"] == "up-to-date"


def test_worker_queries_with_digits_int_refuses_are_400(hostile: Stack) -> None:
    run_id = hostile.trigger("t")
    with hostile.worker() as w:
        for path in (f"{W}/runs/{run_id}/snapshots/latest?after=x&waitMs=%C2%B2",
                     f"{W}/runs/{run_id}/journal?from=%C2%B2"):
            r = w.get(path)
            assert r.status_code == 400, (path, r.text)
            assert set(r.json()["error"]) >= {"code", "message"}


def test_a_wait_of_kind_batch_on_what_is_not_its_batch_is_400_and_leaves_the_journal_readable(hostile: Stack) -> None:
    """Only a replay waits on a batch by ``…/waitpoints/{id}/wait``, its journal entry naming the
    batch's runs: a batch wait on a finished run's waitpoint wrote an entry with none, and every
    later read of the run's journal (each start of the run) was a 500."""
    other = hostile.trigger("t", "finished-child")
    run_id = hostile.trigger("t", "batch-kind")
    started = _dequeue(hostile, other, run_id)
    with hostile.worker() as w:
        done = w.post(f"{W}/runs/{other}/snapshots/{started[other]['snapshot']['id']}/attempts/complete",
                      json={"ok": True, "output": 1})
        assert done.status_code == 200, done.text
        base = f"{W}/runs/{run_id}/snapshots/{started[run_id]['snapshot']['id']}"
        r = w.post(f"{base}/waitpoints/{other}/wait", json={"sequence": 1, "kind": "batch"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_input", r.text
        journal = w.get(f"{W}/runs/{run_id}/journal")
        assert journal.status_code == 200 and journal.json()["journal"] == [], journal.text
        # the same wait as a child's: fine, the run's journal still reads
        child = w.post(f"{base}/waitpoints/{other}/wait", json={"sequence": 1, "kind": "child"})
        assert child.status_code == 200 and child.json()["blocked"] is False, child.text
        entry = w.get(f"{W}/runs/{run_id}/journal").json()["journal"]
        assert [(e["kind"], e["resolved"], e["result"]["ok"]) for e in entry] == [("child", True, True)]


def test_a_wait_until_the_last_day_python_knows_with_a_key_is_accepted(hostile: Stack) -> None:
    """The key of a date wait is kept a day past its date: a day past 9999-12-31 overflowed (500)."""
    run_id = hostile.trigger("t", "wait-9999")
    started = _dequeue(hostile, run_id)[run_id]
    with hostile.worker() as w:
        r = w.post(f"{W}/runs/{run_id}/snapshots/{started['snapshot']['id']}/wait/duration",
                   json={"sequence": 0, "date": "9999-12-31T12:00:00Z", "idempotencyKey": "k"})
        assert r.status_code == 200 and r.json()["blocked"] is True, r.text
