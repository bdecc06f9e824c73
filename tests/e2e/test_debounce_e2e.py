"""Debounce on trigger (options.debounce {key, delay, mode, maxDelay}), against the real server and a
supervisor: one DELAYED run per (environment, task, key) while it waits, its date pushed back by each
trigger (capped by maxDelay), the latest payload with mode "trailing"; concurrent triggers on two
server processes make one run; once the run has started, the key starts a new run."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Stack, start_server, stop


def _key() -> str:
    return f"k-{uuid.uuid4().hex[:12]}"


def _trigger(client: httpx.Client, task: str, payload: Any, **options: Any) -> dict[str, Any]:
    r = client.post(f"/api/v1/tasks/{task}/trigger", json={"payload": payload, "options": options})
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def _runs_tagged(stack: Stack, tag: str) -> list[dict[str, Any]]:
    with stack.client() as c:
        r = c.get("/api/v1/runs", params={"filter[tag]": tag, "page[size]": 100})
    assert r.status_code == 200, r.text
    runs: list[dict[str, Any]] = r.json()["data"]
    return runs


def _when(run: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(run["delayedUntil"].replace("Z", "+00:00"))


@pytest.fixture(scope="module")
def idle(stack: Stack) -> Stack:
    """A project of its own without a worker: its runs stay where the tests leave them, and other
    tests' listings never see them."""
    return stack.project("debounce-idle")


@pytest.fixture(scope="module")
def own(stack: Stack) -> Iterator[Stack]:
    """A project of its own with a supervisor running tests/e2e/tasks_e2e.py."""
    project = stack.project("debounce")
    proc = project.start_supervisor("debounce")
    yield project
    stop(proc)


def test_leading_mode_answers_with_the_same_run_and_keeps_the_first_payload(idle: Stack) -> None:
    key = _key()
    with idle.client() as c:
        first = _trigger(c, "echo", {"n": 1}, debounce={"key": key, "delay": "1m"})
        before = idle.run(first["id"])
        second = _trigger(c, "echo", {"n": 2}, debounce={"key": key, "delay": "1m", "mode": "leading"})
        other_task = _trigger(c, "sync-echo", {"n": 3}, debounce={"key": key, "delay": "1m"})
    assert first["isCached"] is False
    assert second == {"id": first["id"], "isCached": True}
    assert other_task["id"] != first["id"]  # keys are scoped to their task
    run = idle.run(first["id"])
    assert run["status"] == "DELAYED"
    assert run["payload"] == {"n": 1}
    assert _when(run) >= _when(before)  # pushed back to the second trigger + 1m


def test_trailing_mode_replaces_the_payload_and_the_run_executes_once_with_the_last(own: Stack) -> None:
    key, tag = _key(), _key()
    trailing = {"key": key, "mode": "trailing"}
    with own.client() as c:
        # two triggers well inside the window, then one whose short delay makes the run due soon
        ids = [_trigger(c, "echo", {"n": 1}, tags=[tag], debounce={**trailing, "delay": "1m"})["id"],
               _trigger(c, "echo", {"n": 2}, debounce={**trailing, "delay": "1m"})["id"]]
        ids.append(_trigger(c, "echo", {"n": 3}, metadata={"last": True},
                            debounce={**trailing, "delay": "1s"})["id"])
    assert len(set(ids)) == 1
    run = own.wait_for(ids[0])
    assert run["status"] == "COMPLETED", run
    assert run["payload"] == {"n": 3}
    assert run["metadata"] == {"last": True}
    assert run["output"]["payload"] == {"n": 3}
    assert run["output"]["attempt"] == 1
    assert [r["id"] for r in _runs_tagged(own, tag)] == [ids[0]]  # one run, executed once


def test_max_delay_caps_the_push_back_from_the_first_trigger(idle: Stack) -> None:
    key = _key()
    with idle.client() as c:
        first = _trigger(c, "echo", {"n": 1}, debounce={"key": key, "delay": "10s", "maxDelay": "15s"})
        due_first = _when(idle.run(first["id"]))  # = first trigger + 10s
        for n in (2, 3):  # each would push it to now + 1m
            again = _trigger(c, "echo", {"n": n}, debounce={"key": key, "delay": "1m", "maxDelay": "1h"})
            assert again["id"] == first["id"]
            due = _when(idle.run(first["id"]))
            # never past the first trigger + its maxDelay (15s), however long the later delays
            assert due_first < due <= due_first + timedelta(seconds=5, milliseconds=1)


def test_concurrent_triggers_on_two_server_processes_make_one_run(idle: Stack) -> None:
    key, tag = _key(), _key()
    url2, proc = start_server(idle.env, idle.logs / "server-debounce-2.log")
    try:
        barrier = threading.Barrier(20)
        answers: list[dict[str, Any]] = []
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                url = idle.url if i % 2 else url2
                with httpx.Client(base_url=url, timeout=30,
                                  headers={"Authorization": f"Bearer {idle.api_key}"}) as c:
                    barrier.wait(timeout=30)
                    answers.append(_trigger(c, "echo", {"i": i}, tags=[tag],
                                            debounce={"key": key, "delay": "1m", "mode": "trailing"}))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        stop(proc)
    assert errors == []
    assert len({a["id"] for a in answers}) == 1
    assert sorted(a["isCached"] for a in answers) == [False] + [True] * 19
    runs = _runs_tagged(idle, tag)
    assert [r["id"] for r in runs] == [answers[0]["id"]]
    assert runs[0]["status"] == "DELAYED"


def test_a_run_that_has_started_is_not_joined_the_key_starts_a_new_run(own: Stack) -> None:
    key = _key()
    with own.client() as c:
        first = _trigger(c, "echo", {"n": 1}, debounce={"key": key, "delay": "1s"})
        done = own.wait_for(first["id"])
        assert done["status"] == "COMPLETED"
        second = _trigger(c, "echo", {"n": 2}, debounce={"key": key, "delay": "1s"})
    assert second["id"] != first["id"]
    assert second["isCached"] is False
    run = own.wait_for(second["id"])
    assert run["output"]["payload"] == {"n": 2}


def test_batch_items_with_one_key_make_one_run(idle: Stack) -> None:
    key = _key()
    items = [{"task": "echo", "payload": {"n": n}, "options": {"debounce": {"key": key, "delay": "1m"}}}
             for n in (1, 2)] + [{"task": "echo", "payload": {"plain": True}}]
    with idle.client() as c:
        r = c.post("/api/v1/tasks/batch", json={"items": items})
    assert r.status_code == 200, r.text
    runs = r.json()["runs"]
    assert runs[0]["id"] == runs[1]["id"] != runs[2]["id"]
    assert [x["isCached"] for x in runs] == [False, True, False]


def test_an_idempotency_key_is_checked_before_the_debounce_key(idle: Stack) -> None:
    idem = _key()
    with idle.client() as c:
        first = _trigger(c, "echo", {"n": 1}, idempotencyKey=idem, debounce={"key": _key(), "delay": "1m"})
        again = _trigger(c, "echo", {"n": 2}, idempotencyKey=idem, debounce={"key": _key(), "delay": "1m"})
    assert again == {"id": first["id"], "isCached": True}


@pytest.mark.parametrize(("debounce", "field"), [
    ({"key": "", "delay": "5s"}, "options.debounce.key"),
    ({"key": "x" * 513, "delay": "5s"}, "options.debounce.key"),
    ({"delay": "5s"}, "options.debounce.key"),
    ({"key": "k", "delay": -1}, "options.debounce.delay"),
    ({"key": "k", "delay": "soon"}, "options.debounce.delay"),
    ({"key": "k", "delay": "0.5s"}, "options.debounce.delay"),
    ({"key": "k", "delay": True}, "options.debounce.delay"),
    ({"key": "k"}, "options.debounce.delay"),
    ({"key": "k", "delay": "1m", "maxDelay": "30s"}, "options.debounce.maxDelay"),
    ({"key": "k", "delay": "1m", "maxDelay": "later"}, "options.debounce.maxDelay"),
    ({"key": "k", "delay": "1m", "mode": "sideways"}, "options.debounce.mode"),
    ("k", "options.debounce"),
])
def test_bad_debounce_input_is_a_400_naming_the_field(idle: Stack, debounce: Any, field: str) -> None:
    with idle.client() as c:
        r = c.post("/api/v1/tasks/echo/trigger", json={"payload": {}, "options": {"debounce": debounce}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith(f"{field}:"), r.text
        batch = c.post("/api/v1/tasks/batch",
                       json={"items": [{"task": "echo", "options": {"debounce": debounce}}]})
        assert batch.status_code == 400, batch.text
        assert batch.json()["error"]["message"].startswith(f"items.0.{field}:"), batch.text


def test_trigger_and_wait_refuses_debounce(idle: Stack) -> None:
    parent = idle.trigger("echo", {}, delay="1h")
    snapshot = idle.snapshot(parent)["id"]
    with idle.worker() as w:
        r = w.post(f"/engine/v1/worker-actions/runs/{parent}/snapshots/{snapshot}/trigger",
                   json={"sequence": 0, "items": [{"task": "echo", "options": {"debounce": {"key": "k", "delay": 5}}}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("items.0.options.debounce:"), r.text


def test_tasks_wait_on_one_debounced_run(own: Stack) -> None:
    """Two runs trigger the same debounced child from a step and wait.for_run it: one child, run
    once with the later payload (trailing), and both parents get its output."""
    key = _key()
    parents = [own.trigger("waits-for-debounced", {"key": key}) for _ in range(2)]
    done = [own.wait_for(p) for p in parents]
    assert [d["status"] for d in done] == ["COMPLETED", "COMPLETED"], done
    outputs = [d["output"] for d in done]
    assert outputs[0] == outputs[1] and outputs[0]["ok"] is True
    child = own.run(outputs[0]["output"]["run"])
    assert child["status"] == "COMPLETED" and child["attemptCount"] == 1
    assert child["payload"]["from"] in parents
