"""Inside a task, ``trigger`` and ``batch_trigger`` without a key of the author's carry one the
attempt gives the call, the same on every execution of the attempt (a restore replays the task
from its start): before, each carried a random ``sdk:<uuid>``, so a restored run triggered its
children again. A trigger in a step's function counts in that step (a replay does not call it);
another attempt has keys of its own; the run found by the call's own key is its own (is_cached
False)."""

from __future__ import annotations

from typing import Any

import pytest

import run_engine.sdk.tasks as tasks_module
from run_engine.sdk import RunHandle, Task, runtime
from run_engine.sdk.client import Answer


def noop(payload: Any) -> None:
    return None


class _Channel:
    async def call(self, op: str, **data: Any) -> dict[str, Any]:
        return {}


class _Server:
    """The public API's triggers, deduplicated by key as the server does (per task; a batch's key
    per environment)."""

    def __init__(self) -> None:
        self.runs: dict[tuple[str, str], str] = {}
        self.sent: list[tuple[str, dict[str, Any]]] = []

    async def send(self, method: str, path: str, json: Any = None, *, headers: dict[str, str] | None = None,
                   **kwargs: Any) -> Answer:
        if path == "/api/v1/tasks/batch":
            self.sent.append((path, dict(headers or {})))
            key = (headers or {})["idempotency-key"]
            cached = ("batch", key) in self.runs
            self.runs.setdefault(("batch", key), f"run_{len(self.runs)}")
            return Answer({"id": "batch_1", "runs": [{"id": f"{self.runs['batch', key]}_{i}", "taskIdentifier": "t",
                                                     "isCached": cached} for i in range(len(json["items"]))]}, False)
        task = path.split("/")[-2]
        self.sent.append((path, json["options"]))
        key = (task, json["options"]["idempotencyKey"])
        cached = key in self.runs
        self.runs.setdefault(key, f"run_{len(self.runs)}")
        return Answer({"id": self.runs[key], "isCached": cached}, False)


async def _execution(attempt: int, journal: list[dict[str, Any]]) -> list[Any]:
    """One execution of a task that triggers ``a`` (also in a step), ``b`` and a batch of ``a``."""
    a, b = Task(id="a", fn=noop), Task(id="b", fn=noop)
    rt = runtime.Runtime(_Channel(), journal, None, "run_parent", None, attempt)  # type: ignore[arg-type]
    token = runtime.activate(rt)
    try:
        first = await a.trigger(1)

        async def in_step() -> str:
            return (await a.trigger("in step")).id

        stepped = await rt.step("s", in_step)
        return [first, stepped, await b.trigger(2), await a.trigger(3), await a.batch_trigger([4, 5])]
    finally:
        runtime.activate(None)
        del token


async def test_every_execution_of_an_attempt_gets_back_the_runs_its_first_triggered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    server = _Server()
    monkeypatch.setattr(tasks_module, "send", server.send)
    first = await _execution(1, [])
    keys = [o.get("idempotencyKey") or o.get("idempotency-key") for _, o in server.sent]
    assert keys == ["sdk:run_parent:1:a:0", "sdk:run_parent:1:s0:a:0", "sdk:run_parent:1:b:0",
                    "sdk:run_parent:1:a:1", "sdk:run_parent:1:batch:a:0"]
    # restored: the step replays from the journal (its trigger is not made), the others find their runs
    restored = await _execution(1, [{"sequence": 0, "kind": "step", "key": "s", "resolved": True,
                                     "result": first[1]}])
    assert restored == first and len(server.runs) == 5  # before: five more runs
    assert all(isinstance(h, RunHandle) and not h.is_cached for h in [restored[0], *restored[2:4], *restored[4]])
    retried = await _execution(2, [])  # another attempt: runs of its own
    assert not {retried[0].id, retried[2].id, retried[3].id} & {first[0].id, first[2].id, first[3].id}


async def test_an_authors_key_and_ttl_are_kept_and_outside_a_task_a_call_has_a_random_key(
        monkeypatch: pytest.MonkeyPatch) -> None:
    server = _Server()
    monkeypatch.setattr(tasks_module, "send", server.send)
    a = Task(id="a", fn=noop)
    await a.trigger(1)
    # outside a task, a random key kept for the call's tries (an hour: retention keeps a run while its key holds)
    assert server.sent[-1][1]["idempotencyKey"].startswith("sdk:") and server.sent[-1][1]["idempotencyKeyTTL"] == "1h"
    rt = runtime.Runtime(_Channel(), [], None, "run_parent", None, 1)  # type: ignore[arg-type]
    token = runtime.activate(rt)
    try:
        await a.trigger(2, {"idempotencyKey": "mine"})
        assert server.sent[-1][1] == {"idempotencyKey": "mine"}
        await a.trigger(3, {"idempotencyKeyTTL": "1d"})
        assert server.sent[-1][1] == {"idempotencyKey": "sdk:run_parent:1:a:0", "idempotencyKeyTTL": "1d"}
        await a.batch_trigger([4], idempotency_key="batch-mine")
        assert server.sent[-1][1] == {"idempotency-key": "batch-mine"}
    finally:
        runtime.activate(None)
        del token
