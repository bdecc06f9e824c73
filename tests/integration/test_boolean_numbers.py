"""``true`` and ``false`` where a request body takes a number: pydantic reads them as 1 and 0 (and
as 1.0 and 0.0 where it takes a float), so that ``maxRuns: true`` dequeued one run, ``sequence:
false`` journaled step 0 and ``maxAttempts: true`` ran a run once. Each is 400 invalid_input naming
the field, as the queue's limits are (tests/integration/test_queue_settings.py), over the public
API and the worker API alike; a whole number written as a float (2.0) is still taken."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest

from run_engine.engine import TriggerRequest

from .conftest import Harness, api_client

W = "/engine/v1/worker-actions"
TRIGGER = "/api/v1/tasks/hello/trigger"
SNAPSHOT = "snapshot_00000000000000000000000000"


def _options(**options: Any) -> dict[str, Any]:
    return {"payload": {}, "options": options}


def _connect(concurrency: Any = None, max_duration: Any = None) -> dict[str, Any]:
    task = {"id": "hello", **({} if max_duration is None else {"maxDuration": max_duration})}
    return {"workerInstanceName": "w-1", **({} if concurrency is None else {"concurrency": concurrency}),
            "deployment": {"tasks": [task]}}


#: (the field as the 400 names it, public or worker API, path, the body with ``v`` in the field)
Sent = tuple[str, str, str, Callable[[Any], Any]]
CASES: list[Sent] = [
    ("options.maxAttempts", "api", TRIGGER, lambda v: _options(maxAttempts=v)),
    ("options.priority", "api", TRIGGER, lambda v: _options(priority=v)),
    ("options.maxDuration", "api", TRIGGER, lambda v: _options(maxDuration=v)),
    ("options.retry.maxAttempts", "api", TRIGGER, lambda v: _options(retry={"maxAttempts": v})),
    ("options.retry.factor", "api", TRIGGER, lambda v: _options(retry={"factor": v})),
    ("options.retry.minTimeoutInMs", "api", TRIGGER, lambda v: _options(retry={"minTimeoutInMs": v})),
    ("options.retry.maxTimeoutInMs", "api", TRIGGER, lambda v: _options(retry={"maxTimeoutInMs": v})),
    ("rateLimit.period", "api", TRIGGER,  # (named options.queue.QueueOption.…)
     lambda v: _options(queue={"name": "limited", "rateLimit": {"limit": 5, "period": v}})),
    ("items.0.options.maxAttempts", "api", "/api/v1/tasks/batch",
     lambda v: {"items": [{"task": "hello", "options": {"maxAttempts": v}}]}),
    ("runCount", "api", "/api/v3/batches", lambda v: {"runCount": v}),
    ("index", "api", "/api/v3/batches/{batch}/items", lambda v: {"index": v, "task": "hello"}),
    ("delay", "api", "/api/v1/runs/{run}/reschedule", lambda v: {"delay": v}),
    ("expirationTime", "api", "/api/v1/auth/public-tokens", lambda v: {"scopes": ["read:runs"], "expirationTime": v}),
    ("concurrency", "worker", f"{W}/connect", lambda v: _connect(concurrency=v)),
    ("deployment.tasks.0.maxDuration", "worker", f"{W}/connect", lambda v: _connect(max_duration=v)),
    ("maxRuns", "worker", f"{W}/dequeue", lambda v: {"maxRuns": v}),
    ("waitMs", "worker", f"{W}/dequeue", lambda v: {"maxRuns": 1, "waitMs": v}),
    ("sequence", "worker", f"{W}/runs/{{run}}/snapshots/{SNAPSHOT}/wait/duration",
     lambda v: {"sequence": v, "seconds": 60}),
    ("seconds", "worker", f"{W}/runs/{{run}}/snapshots/{SNAPSHOT}/wait/duration",
     lambda v: {"sequence": 0, "seconds": v}),
    ("sequence", "worker", f"{W}/runs/{{run}}/snapshots/{SNAPSHOT}/waitpoints/waitpoint_x/wait",
     lambda v: {"sequence": v}),
    ("items.0.sequence", "worker", f"{W}/waits",
     lambda v: {"items": [{"runId": "run_x", "snapshotId": SNAPSHOT, "waitpointId": "waitpoint_x", "sequence": v}]}),
    ("sequence", "worker", f"{W}/runs/{{run}}/snapshots/{SNAPSHOT}/trigger",
     lambda v: {"sequence": v, "items": [{"task": "hello"}]}),
    ("sequence", "worker", f"{W}/runs/{{run}}/journal", lambda v: {"snapshotId": SNAPSHOT, "sequence": v, "key": "a"}),
]


@pytest.mark.parametrize(("field", "caller", "path", "make"), CASES,
                         ids=[f"{path.rsplit('/', 1)[-1]}:{field}" for field, _, path, _ in CASES])
async def test_true_or_false_is_refused_as_a_number_not_read_as_one_or_zero(
        h: Harness, field: str, caller: str, path: str, make: Callable[[Any], Any]) -> None:
    """Sent ``true`` (and ``false``), each number of a request body is 400 invalid_input naming the
    field; before, pydantic read them as 1 and 0 and most of these requests were taken."""
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello",
                                                delay_until=datetime.fromtimestamp(h.engine.now() + 3600, UTC)))
    credential = h.env.env_worker_group_token if caller == "worker" else None
    async with api_client(h, credential) as client:
        batch = ""
        if "{batch}" in path:
            opened = await client.post("/api/v3/batches", json={"runCount": 1})
            assert opened.status_code == 200, opened.text
            batch = opened.json()["id"]
        url = path.format(run=run.id, batch=batch)
        for value in (True, False):
            if "{batch}" in path:  # NDJSON, one item a line
                sent = await client.post(url, content=orjson.dumps(make(value)),
                                         headers={"Content-Type": "application/x-ndjson"})
            else:
                sent = await client.post(url, json=make(value))
            assert sent.status_code == 400, (value, sent.text)
            error = sent.json()["error"]
            assert error["code"] == "invalid_input", error
            assert f"{field}: " in error["message"] and "true or false" in error["message"], error


async def test_a_whole_number_written_as_a_float_is_still_taken(h: Harness) -> None:
    """What the refusal of true and false keeps: ``2.0`` is 2 where a whole number is expected."""
    async with api_client(h) as api:
        sent = await api.post(TRIGGER, json=_options(maxAttempts=2.0, retry={"maxAttempts": 3.0,
                                                                             "minTimeoutInMs": 100.0}))
        assert sent.status_code == 200, sent.text
        opened = await api.post("/api/v3/batches", json={"runCount": 2.0})
        assert opened.status_code == 200, opened.text
    async with api_client(h, h.env.env_worker_group_token) as worker:
        dequeued = await worker.post(f"{W}/dequeue", json={"maxRuns": 1.0, "waitMs": 0.0})
        assert dequeued.status_code == 200, dequeued.text
