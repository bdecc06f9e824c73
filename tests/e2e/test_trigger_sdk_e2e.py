"""Trigger.dev's official client, unchanged, against a real run-engine server: `@trigger.dev/sdk`
4.8.3 (pinned in tests/e2e/trigger_sdk/, installed with npm into the test's own folder) makes each
management call of tests/e2e/trigger_sdk/check.mjs, and this test checks what each call returned,
not only that it did not throw."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from .conftest import ROOT, Stack

HERE = ROOT / "tests" / "e2e" / "trigger_sdk"


@pytest.fixture(scope="module")
def sdk_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is needed for the Trigger.dev SDK test (Node.js 18 or newer)")
    folder = tmp_path_factory.mktemp("trigger-sdk")
    for name in ("package.json", "package-lock.json", "check.mjs"):
        shutil.copy(HERE / name, folder / name)
    subprocess.run([npm, "ci", "--silent", "--no-audit", "--no-fund"], cwd=folder, check=True, timeout=300,
                   capture_output=True)
    return folder


@pytest.fixture(scope="module")
def served(stack: Stack) -> Stack:
    own = stack.project("trigger-sdk")
    own.start_supervisor("trigger-sdk", concurrency=2)
    deadline = time.monotonic() + 60
    while True:
        with own.client() as c:
            if any(q["name"] == "task/echo" for q in c.get("/api/v1/queues").json()["data"]):
                return own
        assert time.monotonic() < deadline, "the supervisor did not deploy"
        time.sleep(0.1)


def run_check(sdk_dir: Path, stack: Stack) -> dict[str, Any]:
    node = shutil.which("node")
    assert node is not None
    out = subprocess.run([node, "check.mjs"], cwd=sdk_dir, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "TRIGGER_API_URL": stack.url, "TRIGGER_SECRET_KEY": stack.api_key})
    assert out.returncode == 0, out.stderr[-3000:]
    results: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return results


def test_the_official_sdk_works_unchanged(sdk_dir: Path, served: Stack) -> None:
    r = run_check(sdk_dir, served)
    failed = {name: call.get("error") for name, call in r.items() if not call["ok"]}
    assert failed == {}, failed
    v = {name: call.get("value") for name, call in r.items()}

    first = v["tasks.trigger"]
    assert first["id"].startswith("run_") and first["isCached"] is False and first["publicAccessToken"]
    assert v["tasks.trigger.again"]["id"] == first["id"] and v["tasks.trigger.again"]["isCached"] is True
    run = v["runs.retrieve"]
    assert run["status"] == "COMPLETED" and run["isSuccess"] is True and run["ttl"] == "10m"
    assert run["output"]["payload"] == {"hello": "sdk", "when": "1970-01-01T00:00:00.000Z"}  # superjson decoded
    assert run["tags"] == ["sdk", "compat"] and run["attemptCount"] == 1
    assert v["runs.poll"] == "COMPLETED"
    raw = v["runs.retrieve.raw"]  # the machine asked for; the key as the SDK hashed it (not the plain text)
    assert raw["machine"] == "small-2x" and raw["idempotencyKey"] not in (None, "sdk-key-1")
    watched = v["runs.subscribeToRun"]  # the shape stream: each change, closed once the run finished
    assert "timedOut" not in watched and watched["seen"][-1] == "COMPLETED" and watched["isSuccess"] is True
    assert watched["output"]["attempt"] == 1 and len(watched["seen"]) >= 2
    replayed = v["runs.replay"]
    assert replayed.startswith("run_") and replayed != first["id"]
    assert served.wait_for(replayed)["output"]["payload"] == run["output"]["payload"]
    assert v["runs.reschedule"]["status"] == "DELAYED" and "GMT" in v["runs.reschedule"]["delayedUntil"]
    assert v["runs.cancel"] == "CANCELED"
    listed = v["runs.list"]
    assert listed and all("sdk" in item["tags"] for item in listed)
    assert all(item["env"]["name"] == "dev" and item["env"]["id"].startswith("env_") for item in listed)
    assert first["id"] in [item["id"] for item in listed]
    assert first["id"] in v["runs.list.status"]
    assert v["apiClient.updateRunMetadata"] == {"reply": {"step": 2}, "run": {"step": 2}}
    assert v["apiClient.addTags"] == ["sdk", "compat", "added"]

    token = v["wait.createToken"]
    assert token["id"].startswith("waitpoint_") and token["isCached"] is False and "/callback/" in token["url"]
    assert v["wait.completeToken"] == {"success": True}
    assert v["wait.retrieveToken"] == {"status": "COMPLETED", "output": {"approved": True}}
    assert token["id"] in v["wait.listTokens"]

    with served.client() as c:
        for name in ("tasks.batchTrigger", "batch.trigger"):
            made = v[name]
            assert made["batchId"].startswith("batch_") and made["runCount"] == 2, name
            batch = c.get(f"/api/v1/batches/{made['batchId']}").json()
            assert batch["runCount"] == 2, (name, batch)
            for run_id in batch["runs"]:
                assert served.wait_for(run_id)["status"] == "COMPLETED"
        per_item = [served.run(run_id) for run_id in c.get(f"/api/v1/batches/{v['tasks.batchTrigger']['batchId']}")
                    .json()["runs"]]  # each item's own options
        tagged = [r for r in per_item if r["tags"] == ["b"]]  # (a batch lists its runs in no set order)
        assert sorted(r["tags"] for r in per_item) == [[], ["b"]] and tagged[0].get("delayedUntil") is not None
        assert [r for r in per_item if not r["tags"]][0].get("delayedUntil") is None
        seq = v["apiClient.batchTriggerV3.sequential"]  # the one-request batch, its strategy header
        assert seq["runCount"] == 2 and seq["publicAccessToken"] is True
        made = [served.wait_for(run_id) for run_id in c.get(f"/api/v1/batches/{seq['id']}").json()["runs"]]
        assert sorted((r["taskIdentifier"], r["tags"], r["status"]) for r in made) == [
            ("echo", ["seq-0"], "COMPLETED"), ("sync-echo", ["seq-1"], "COMPLETED")]
        bad = c.post("/api/v2/tasks/batch", json={"items": [{"task": "echo"}]},
                     headers={"batch-processing-strategy": "all-at-once"})
        assert bad.status_code == 400 and "batch-processing-strategy" in bad.json()["error"]["message"]

    queues = {q["name"]: q for q in v["queues.list"]}
    assert queues["task/echo"]["type"] == "task" and queues["e2e-limited"]["type"] == "custom"
    assert v["queues.retrieve.task"] == {"name": "task/echo", "type": "task"}
    assert (v["queues.pause.task"], v["queues.resume.task"]) == (True, False)
    assert (v["queues.pause.custom"], v["queues.resume.custom"]) == (True, False)
    assert v["queues.overrideConcurrencyLimit"] == 3 and v["queues.resetConcurrencyLimit"] is None

    sched = v["schedules.create"]
    assert sched["id"].startswith("sched_") and sched["task"] == "echo" and sched["active"] is True
    assert sched["cron"] == "0 3 * * *" and "03:00:00" in sched["nextRun"]
    assert v["schedules.retrieve"] == sched["id"] and sched["id"] in v["schedules.list"]
    assert v["schedules.update"] == "0 4 * * *"
    assert (v["schedules.deactivate"], v["schedules.activate"], v["schedules.del"]) == (False, True, True)
    with served.client() as c:
        assert c.get(f"/api/v1/schedules/{sched['id']}").status_code == 404

    # public access tokens: the run's own (from the trigger) reads it and nothing else
    assert v["publicAccessToken.retrieve"] == {"id": first["id"], "status": "COMPLETED", "other": 403, "list": 403}
    tagged = v["auth.createPublicToken.readTags"]  # a browser following the runs of a tag
    assert tagged["statuses"][-1] == "COMPLETED" and tagged["others"] == 0
    assert tagged["retrieve"] == tagged["tagged"] and tagged["untagged"] == 403
    batch_seen = v["subscribeToBatch"]  # the batch's own token follows its runs to the end
    assert len(batch_seen["ids"]) == 2 and batch_seen["completed"] == 2
    retrieved = v["batch.retrieve"]  # the SDK's batch.retrieve (GET /api/v2/batches/{id}), parsed by its schema
    assert retrieved["id"] is True and retrieved["runCount"] == retrieved["runs"] == 2
    assert retrieved["status"] in ("PENDING", "COMPLETED") and retrieved["createdAt"] is True
    assert retrieved["errors"] == []
    assert v["idempotencyKeys.reset"] == {"same": True, "fresh": True, "reset": True}  # a new run after the reset
    bulk = v["runs.bulk"]  # runs.bulk.cancel by filter, poll, list (a page at a time), replay by id and abort
    assert bulk["status"] == "COMPLETED" and bulk["counts"] == {"total": 2, "success": 2, "failure": 0}
    assert bulk["name"] == "sdk bulk" and bulk["statuses"] == ["CANCELED", "CANCELED"]
    assert bulk["listed"] is True and bulk["pages"] >= 2
    assert (bulk["abort"], bulk["afterAbort"]) in (("aborted", "ABORTED"), (409, "COMPLETED"))
    assert bulk["refused"] == 400  # a filter run-engine cannot honour: refused, not widened
    uploaded = v["tasks.trigger.largePayload"]  # uploaded by the SDK, then named by the trigger
    assert uploaded["status"] == "COMPLETED" and uploaded["length"] == 150 * 1024 and uploaded["batchRuns"] == 2
    assert uploaded["when"] == "1970-01-01T00:00:00.000Z"  # superjson decoded, as an inline payload is
    with served.client() as c:
        items = [served.wait_for(run_id) for run_id in c.get(f"/api/v1/batches/{uploaded['batchId']}").json()["runs"]]
        assert sorted(len(orjson.dumps(r["payload"])) > 140 * 1024 for r in items) == [False, True]
    large = v["subscribeToRunsWithTag.largePackets"]  # sent by reference, fetched whole by the SDK
    assert large == {"id": large["id"], "status": "COMPLETED", "payloadLength": 200 * 1024,
                     "outputLength": 200 * 1024, "sentAs": ["application/store", "application/store"]}
    meta = v["subscribeToRunsWithTag.largeMetadata"]  # 10 MB of metadata: in two answers, every run whole
    assert meta["runs"] == meta["whole"] == 40 and 0 < meta["firstAnswer"] < 40 and meta["firstUpToDate"] is False
    assert v["electric.mustRefetch"] == {"refetched": True, "seen": True}  # started over at -1, by itself
    once = v["auth.createTriggerPublicToken"]
    assert once["id"].startswith("run_") and once["again"] == 401  # one-time use
    many = v["auth.createTriggerPublicToken.multipleUse"]
    assert len(set(many["ids"])) == 2 and many["otherTask"] == 403
    waited = v["wait.publicAccessToken"]
    assert waited["completed"] == {"success": True} and waited["other"] == 403


def test_the_two_phase_batch_deduplicates_a_retried_stream_and_seals(served: Stack) -> None:
    lines = "\n".join(json.dumps({"index": i, "task": "echo", "payload": {"i": i}}) for i in range(3))
    with served.client() as c:
        opened = c.post("/api/v3/batches", json={"runCount": 3, "idempotencyKey": "stream-1"}).json()
        again = c.post("/api/v3/batches", json={"runCount": 3, "idempotencyKey": "stream-1"}).json()
        assert again == {**opened, "isCached": True} and opened["isCached"] is False
        ndjson = {"Content-Type": "application/x-ndjson"}
        part = c.post(f"/api/v3/batches/{opened['id']}/items", content=lines.split("\n")[0], headers=ndjson).json()
        assert part == {"id": opened["id"], "itemsAccepted": 1, "itemsDeduplicated": 0, "sealed": False,
                        "enqueuedCount": 1, "expectedCount": 3}
        whole = c.post(f"/api/v3/batches/{opened['id']}/items", content=lines, headers=ndjson).json()
        assert whole == {"id": opened["id"], "itemsAccepted": 2, "itemsDeduplicated": 1, "sealed": True}
        assert c.get(f"/api/v1/batches/{opened['id']}").json()["runCount"] == 3
        # an item whose idempotency key names a run of another batch joins that run; the batch still seals
        elsewhere = served.trigger("echo", {"x": 1}, idempotencyKey="joined-elsewhere")
        two = c.post("/api/v3/batches", json={"runCount": 2}).json()
        joined = "\n".join(json.dumps(item) for item in (
            {"index": 0, "task": "echo", "payload": {"x": 1}, "options": {"idempotencyKey": "joined-elsewhere"}},
            {"index": 1, "task": "echo", "payload": {"x": 2}}))
        sealed = c.post(f"/api/v3/batches/{two['id']}/items", content=joined, headers=ndjson).json()
        assert sealed == {"id": two["id"], "itemsAccepted": 1, "itemsDeduplicated": 1, "sealed": True}
        assert served.run(elsewhere).get("batchId") is None
        bad = c.post(f"/api/v3/batches/{opened['id']}/items", content='{"index": 7, "task": "echo"}', headers=ndjson)
        assert bad.status_code == 400 and "runCount" in bad.json()["error"]["message"]
        # more lines than runCount: refused before any is parsed (a body of a million lines held
        # the server's event loop for seconds)
        bad = c.post(f"/api/v3/batches/{opened['id']}/items", content=lines + "\n" + lines, headers=ndjson)
        assert bad.status_code == 400 and "more items than the batch's runCount 3" in bad.json()["error"]["message"]
        bad = c.post(f"/api/v3/batches/{opened['id']}/items", content="{nope", headers=ndjson)
        assert bad.status_code == 400 and "line 1" in bad.json()["error"]["message"]
        assert c.post("/api/v3/batches/batch_aaaaaaaaaaaaaaaaaaaaaaaa/items", content=lines,
                      headers=ndjson).status_code == 404
        assert c.post("/api/v3/batches", json={"runCount": 0}).status_code == 400
