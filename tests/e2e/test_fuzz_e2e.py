"""Fuzzing the HTTP API (issue 10): schemathesis generates requests from `GET /openapi.json` for
every operation, valid and invalid ones, against the real server, with an API key on the public
API and a worker group token on the worker API. Every response must be documented: no 5xx, the
documented status codes and content types, bodies that match the documented schema (errors the
error shape). A fixed seed and a bounded number of examples keep it reproducible and short;
`FUZZ_EXAMPLES=150 FUZZ_RANDOM=1 pytest tests/e2e/test_fuzz_e2e.py` explores further."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from .conftest import Stack

W = "/engine/v1/worker-actions"
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "30"))  # per operation and mode: about 2,800 requests in all


@pytest.fixture(scope="module")
def fuzz_tenant(stack: Stack) -> Iterator[dict[str, Any]]:
    """A tenant with one of each thing, whose ids the generated requests use half the time (random
    ids alone would only ever reach the 404 answers)."""
    creds = json.loads(stack.cli("bootstrap", "--org", "e2e", "--project", "fuzz", "--env", "dev").stdout)
    api = requests.Session()
    api.headers["Authorization"] = f"Bearer {creds['apiKey']}"
    worker = requests.Session()
    worker.headers["Authorization"] = f"Bearer {creds['workerGroupToken']}"
    assert worker.post(f"{stack.url}{W}/connect", timeout=30, json={
        "workerInstanceName": "fuzz", "deployment": {"version": "f1", "tasks": [{"id": "t"}]}}).status_code == 200
    runs = [api.post(f"{stack.url}/api/v1/tasks/t/trigger", json={"payload": i}, timeout=30).json()["id"]
            for i in range(3)]
    started = worker.post(f"{stack.url}{W}/dequeue", timeout=30,
                          json={"maxRuns": 1, "waitMs": 2000, "startAttempts": True}).json()["runs"][0]["attempt"]
    token = api.post(f"{stack.url}/api/v1/waitpoints/tokens", json={}, timeout=30).json()
    batch = api.post(f"{stack.url}/api/v1/tasks/batch", json={"items": [{"task": "t"}]}, timeout=30).json()["id"]
    schedule = api.post(f"{stack.url}/api/v1/schedules", json={"task": "t", "cron": "0 0 1 1 *"}, timeout=30).json()
    known = {"runId": started["run"]["id"], "snapshotId": started["snapshot"]["id"], "waitpointId": token["id"],
             "signature": token["url"].rsplit("/", 1)[1], "batchId": batch, "scheduleId": schedule["id"],
             "name": "task/t", "taskId": "t", "version": "f1"}
    yield {**creds, "known": known, "runs": runs}


def _document() -> dict[str, Any]:
    from run_engine.api.app import routes
    from run_engine.api.openapi import openapi_document

    return openapi_document(routes())


SCHEMA = schemathesis.openapi.from_dict(_document())
POSITIVE, NEGATIVE = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
# every operation with valid input, and those that take input with invalid input too (a stream does
# not end: it is tested in test_limits_e2e and test_realtime)
CASES = [(op.method.upper(), op.path, mode) for op in (r.ok() for r in SCHEMA.get_all_operations())
         if not op.path.startswith("/realtime/")
         for mode in ((POSITIVE, NEGATIVE) if op.body or op.path_parameters or op.query else (POSITIVE,))]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def test_the_served_document_is_the_one_fuzzed(stack: Stack) -> None:
    assert requests.get(f"{stack.url}/openapi.json", timeout=30).json() == json.loads(json.dumps(_document()))


@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=[f"{m} {p} {g.value}" for m, p, g in CASES])
def test_every_operation_answers_as_documented(method: str, path: str, mode: schemathesis.GenerationMode,
                                               stack: Stack, fuzz_tenant: dict[str, Any]) -> None:
    operation = SCHEMA[path][method]
    key = fuzz_tenant["workerGroupToken"] if path.startswith(W) else fuzz_tenant["apiKey"]
    headers = {} if "/callback/" in path or path in ("/", "/healthz", "/openapi.json") else \
        {"Authorization": f"Bearer {key}"}

    known = {k: v for k, v in fuzz_tenant["known"].items() if k in {p["name"] for p in (
        operation.definition.raw.get("parameters") or []) if p.get("in") == "path"}}
    cases = operation.as_strategy(generation_mode=mode)
    if known:
        cases = st.one_of(cases, operation.as_strategy(generation_mode=mode, path_parameters=known))

    @given(case=cases)
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=not os.environ.get("FUZZ_RANDOM"),  # a fixed seed in CI; FUZZ_RANDOM=1 explores
              database=None, phases=[Phase.generate])
    def run(case: schemathesis.Case) -> None:
        calls.append(case)
        for part in (case.body, case.query):  # a long-poll may rightly wait its full minute: keep it short
            if isinstance(part, dict) and "waitMs" in part:
                try:
                    long_poll = float(part["waitMs"]) > 200  # also "30000" and 30000.0, which are accepted
                except (TypeError, ValueError, OverflowError):
                    long_poll = False
                if long_poll:
                    part["waitMs"] = 200
        case.call_and_validate(base_url=stack.url, headers=headers, timeout=30, checks=CHECKS)

    calls: list[schemathesis.Case] = []
    run()
    assert calls  # something was sent
