"""``metadata`` in a task: changes applied to the execution's copy at once and buffered, sent in one
request by a flush (awaited, automatic, before a wait, at completion); a replay sends nothing the
execution before it sent. The server's side: tests/integration/test_metadata_operations.py; through
a real server and supervisor: tests/e2e/test_waits_e2e.py."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from run_engine.sdk import metadata, task, wait
from run_engine.sdk import metadata as md_mod
from run_engine.sdk import runtime as rt_mod
from run_engine.sdk.errors import TaskError
from run_engine.sdk.runtime import Channel, Runtime
from supervisor.executor import _run_one


class _Server:
    """``PUT …/metadata`` as the server answers it (its own operations applied, with the engine's
    semantics), recording each body; ``fail`` makes the next requests fail."""

    def __init__(self, metadata: dict[str, Any] | None = None) -> None:
        from run_engine import metadata_ops

        self._ops = metadata_ops
        self.metadata: dict[str, Any] = metadata or {}
        self.bodies: list[dict[str, Any]] = []
        self.keys: list[str] = []  # each body's Idempotency-Key
        self.tried: list[str] = []  # the key of every request, failed ones too
        self.fail: list[BaseException] = []
        self.gate: asyncio.Event | None = None  # held closed: a request waits (one under way)
        self.log: list[str] | None = None

    async def __call__(self, run_id: str, body: dict[str, Any], key: str) -> Any:
        self.tried.append(key)
        if self.log is not None:
            self.log.append("metadata")
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise self.fail.pop(0)
        self.bodies.append(body)
        self.keys.append(key)
        ops = [self._ops.parse_op(op, f"operations.{i}") for i, op in enumerate(body["operations"])]
        self.metadata, _ = self._ops.apply(self.metadata, ops, self._ops.Budget())
        return {"metadata": self.metadata}


class _Channel:
    def __init__(self, log: list[str] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.log = log
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def call(self, op: str, **data: Any) -> dict[str, Any]:
        self.calls.append((op, data))
        if self.log is not None:
            self.log.append(op)
        return {"result": None}


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> _Server:
    s = _Server()
    monkeypatch.setattr(md_mod, "_put", s)
    monkeypatch.setattr(md_mod, "SETTLE_BACKOFF_S", 0)
    return s


async def _in_task(fn: Callable[[], Awaitable[Any]], *, journal: list[dict[str, Any]] | None = None,
                   seed: Any = None, log: list[str] | None = None) -> Any:
    """``fn`` as a task's code, in a runtime of run ``run_1`` (as the executor sets it up)."""
    rt = Runtime(_Channel(log), journal or [], None, "run_1", seed)  # type: ignore[arg-type]
    token = rt_mod.activate(rt)
    try:
        return await fn()
    finally:
        if rt.metadata is not None:
            rt.metadata.close()
        rt_mod._current.reset(token)


async def _until(check: Callable[[], bool], within_s: float = 10) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "not in time"
        await asyncio.sleep(0.005)


async def test_outside_a_task_every_function_raises() -> None:
    for call in (metadata.current, lambda: metadata.get("a"), lambda: metadata.set("a", 1),
                 lambda: metadata.increment("a"), lambda: metadata.parent.increment("a"),
                 lambda: metadata.root.append("a", 1)):
        with pytest.raises(RuntimeError, match=r"metadata\.\S+ can only be used inside a running task"):
            call()
    with pytest.raises(RuntimeError, match="metadata.flush can only be used inside a running task"):
        await metadata.flush()


async def test_changes_apply_to_the_copy_at_once_with_the_servers_semantics(server: _Server) -> None:
    async def body() -> None:
        assert metadata.current() == {"seed": True, "items": [1, 2, 1], "deep": {"a": {}}}
        metadata.set("status", "running")
        metadata.set("$.deep.a.b", [1])
        metadata.increment("done")
        metadata.increment("done", by=2.5)
        metadata.decrement("left", by=-3)  # as Trigger.dev: by its absolute value
        metadata.append("items", 3)
        metadata.append("new", {"x": 1})
        metadata.remove("items", 1)
        metadata.delete("seed")
        metadata.set("when", datetime(2026, 1, 2, tzinfo=UTC))  # as JSON has it
        now = metadata.current()
        assert now == {"items": [2, 3], "deep": {"a": {"b": [1]}}, "status": "running", "done": 3.5,
                       "left": -3, "new": [{"x": 1}], "when": "2026-01-02T00:00:00+00:00"}
        now["items"].append("mine")  # a copy: the execution's own is not changed through it
        assert metadata.get("items") == [2, 3] and metadata.get("missing") is None
        assert server.bodies == []  # buffered, not sent yet
        metadata.replace({"fresh": 1})
        assert metadata.current() == {"fresh": 1}
        await metadata.flush()

    await _in_task(body, seed={"seed": True, "items": [1, 2, 1], "deep": {"a": {}}})
    # the replacement supersedes what was buffered before it: one operation sent
    assert server.bodies == [{"operations": [{"type": "update", "value": {"fresh": 1}}], "parentOperations": [],
                              "rootOperations": []}]


async def test_a_value_that_is_not_json_or_a_bad_operation_raises_at_the_call(server: _Server) -> None:
    async def body() -> None:
        with pytest.raises(TypeError, match="metadata.set: object is not JSON"):
            metadata.set("a", object())
        with pytest.raises(ValueError, match="metadata.increment.value: must be a number"):
            metadata.increment("a", "1")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="metadata.decrement.value: must be a number"):
            metadata.decrement("a", True)
        with pytest.raises(ValueError, match="metadata.increment.value: must be a number"):
            metadata.increment("a", 10**400)  # past a double: not an OverflowError out of the task's call
        with pytest.raises(ValueError, match="metadata.root.decrement.value: must be a number"):
            metadata.root.decrement("a", 10**400)
        with pytest.raises(ValueError, match="wildcards"):
            metadata.set("$.a.*", 1)
        with pytest.raises(ValueError, match="past the end of the list"):
            metadata.set("$.items.5", 1)
        with pytest.raises(TypeError, match="takes an object"):
            metadata.replace([1])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="metadata.parent.set.key"):
            metadata.parent.set("x" * 2000, 1)
        assert metadata.current() == {"items": []}
        await metadata.flush()

    await _in_task(body, seed={"items": []})
    assert server.bodies == []  # nothing buffered


async def test_a_flush_sends_the_three_lists_in_one_request_and_takes_the_servers_answer(server: _Server) -> None:
    server.metadata = {"count": 10, "byChildren": 4}  # changed by others since the run started

    async def body() -> None:
        metadata.increment("count")
        metadata.parent.increment("children")
        metadata.root.append("log", "hello")
        metadata.parent.decrement("left", by=2)
        assert metadata.current() == {"count": 1}  # the parent's and root's are not applied here
        server.gate = asyncio.Event()
        flushing = asyncio.create_task(metadata.flush())
        await _until(lambda: md_mod._state("x").pending == 0)  # taken: on its way
        metadata.append("later", 1)  # made while the request is under way
        server.gate.set()
        await flushing
        # the server's metadata, with the change made since applied again
        assert metadata.current() == {"count": 11, "byChildren": 4, "later": [1]}
        await metadata.flush()
        assert metadata.current() == {"count": 11, "byChildren": 4, "later": [1]}

    await _in_task(body)
    assert server.bodies == [
        {"operations": [{"type": "increment", "key": "count", "value": 1}],
         "parentOperations": [{"type": "increment", "key": "children", "value": 1},
                              {"type": "increment", "key": "left", "value": -2}],
         "rootOperations": [{"type": "append", "key": "log", "value": "hello"}]},
        {"operations": [{"type": "append", "key": "later", "value": 1}], "parentOperations": [],
         "rootOperations": []}]


async def test_a_counter_bumped_in_a_loop_is_one_operation_and_a_request_holds_1000_at_most(server: _Server) -> None:
    async def body() -> None:
        for _ in range(5000):
            metadata.increment("done")
        for i in range(2500):
            metadata.set(f"k{i}", i)
        metadata.increment("done", by=0.5)  # not folded: floats add up differently
        assert md_mod._state("x").pending == 2502
        await metadata.flush()

    await _in_task(body)
    assert [sum(len(v) for v in b.values()) for b in server.bodies] == [1000, 1000, 502]
    assert server.bodies[0]["operations"][0] == {"type": "increment", "key": "done", "value": 5000}
    assert server.metadata["done"] == 5000.5 and server.metadata["k2499"] == 2499


async def test_the_server_away_keeps_the_changes_a_refusal_drops_them(server: _Server) -> None:
    async def body() -> None:
        metadata.increment("count")
        server.fail = [TaskError(503, "unavailable", "PostgreSQL unreachable")] * 3
        with pytest.raises(TaskError, match="503"):
            await metadata.flush()  # three tries, then raised: kept
        assert server.bodies == [] and md_mod._state("x").pending == 1
        server.fail = [OSError("connection refused")]
        await metadata.flush()  # tried again after the first failure
        assert server.metadata == {"count": 1}

        metadata.set("huge", "x")
        metadata.increment("count")
        server.fail = [TaskError(413, "payload_too_large", "operations: metadata over 262144 bytes")]
        with pytest.raises(TaskError, match="413"):
            await metadata.flush()
        # dropped, and the copy is the server's again
        assert md_mod._state("x").pending == 0 and metadata.current() == {"count": 1}
        await metadata.flush()

    await _in_task(body)
    assert len(server.bodies) == 1


async def test_a_request_not_answered_goes_again_whole_with_its_key(server: _Server) -> None:
    """The server may have applied a request whose answer was lost: it goes again as it was, with
    its Idempotency-Key (the server applies a key once), and the changes made since in another."""
    async def body() -> None:
        metadata.increment("count")
        metadata.parent.increment("children")
        server.fail = [TaskError(0, "outcome_unknown", "the answer was lost")] * 3
        with pytest.raises(TaskError, match="lost"):
            await metadata.flush()
        assert md_mod._state("x").pending == 2
        metadata.increment("count", by=2)  # not folded into the kept request
        metadata.parent.increment("children")
        assert metadata.current() == {"count": 3}
        await metadata.flush()
        assert metadata.current() == {"count": 3} and md_mod._state("x").pending == 0

    await _in_task(body)
    assert server.bodies == [
        {"operations": [{"type": "increment", "key": "count", "value": 1}],
         "parentOperations": [{"type": "increment", "key": "children", "value": 1}], "rootOperations": []},
        {"operations": [{"type": "increment", "key": "count", "value": 2}],
         "parentOperations": [{"type": "increment", "key": "children", "value": 1}], "rootOperations": []}]
    first, second = server.keys
    assert first != second and server.tried == [first] * 4 + [second]


async def test_changes_are_sent_about_every_second_without_a_flush(server: _Server, monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(md_mod, "FLUSH_INTERVAL_S", 0.01)

    async def body() -> None:
        state = md_mod._state("x")
        assert state._timer is None  # nothing armed while nothing changed
        metadata.set("progress", 0.5)
        await _until(lambda: server.metadata == {"progress": 0.5})
        await _until(lambda: not state._armed)  # nothing left: the timer is not armed again
        assert state._timer is None and state._task is None
        server.fail = [TaskError(400, "invalid_input", "operations.0: refused")]
        metadata.set("progress", 0.75)
        await _until(lambda: bool(caplog.records))  # logged, and raised by the next flush
        assert "refused" in caplog.records[0].getMessage()
        with pytest.raises(TaskError, match="400"):
            await metadata.flush()
        await metadata.flush()  # raised once
        server.fail = [TaskError(502, "bad_gateway", "")]
        metadata.set("progress", 1)
        await _until(lambda: server.metadata == {"progress": 1})  # kept, and sent by the next one

    with caplog.at_level(logging.WARNING, logger="run_engine.sdk.metadata"):
        await _in_task(body)


async def test_a_replay_sends_nothing_until_it_has_taken_the_journals_last_entry(server: _Server) -> None:
    """Restored after a wait, the task runs from the start: the increment before the wait was sent
    by the execution before (the server's metadata, the copy's start, holds it), and is not counted
    again; the one after the journal's end is new."""
    journal = [{"sequence": 0, "kind": "step", "key": "a", "resolved": True, "result": "A"},
               {"sequence": 1, "kind": "wait", "key": None, "resolved": True, "result": None}]
    server.metadata = {"count": 1, "events": ["before"]}

    async def body() -> None:
        rt = rt_mod.require("test")
        assert rt.replaying()
        metadata.increment("count")
        metadata.append("events", "before")
        metadata.parent.increment("children")
        assert await rt.step("a", lambda: "never run") == "A"
        metadata.increment("count")  # still before the journal's last entry
        assert metadata.current() == {"count": 1, "events": ["before"]} and md_mod._state("x").pending == 0
        await wait.for_(seconds=5)  # replayed: the journal's last entry
        assert not rt.replaying()
        metadata.increment("count", by=2)
        metadata.append("events", "after")
        assert metadata.current() == {"count": 3, "events": ["before", "after"]}
        await metadata.flush()

    await _in_task(body, journal=journal, seed={"count": 1, "events": ["before"]})
    assert server.metadata == {"count": 3, "events": ["before", "after"]}
    assert server.bodies == [{"operations": [{"type": "increment", "key": "count", "value": 2},
                                             {"type": "append", "key": "events", "value": "after"}],
                              "parentOperations": [], "rootOperations": []}]


async def test_changes_are_sent_before_the_run_blocks_on_a_wait(server: _Server) -> None:
    log: list[str] = []
    server.log = log

    async def body() -> None:
        await wait.for_(seconds=1)  # nothing changed: no request
        metadata.set("stage", "waiting")
        await wait.for_(seconds=1)
        await wait.for_(seconds=1)  # nothing changed since

    await _in_task(body, log=log)
    assert log == ["wait", "metadata", "wait", "wait"]
    assert server.metadata == {"stage": "waiting"}


# --- in the executor ------------------------------------------------------------------------------

@task(id="metadata-unit-async")
async def _async_task(payload: Any) -> Any:
    if payload == "none":
        return "untouched"
    metadata.set("stage", "done")
    metadata.parent.increment("children")
    if payload == "fail":
        raise ValueError("failed after its changes")
    return metadata.current()


@task(id="metadata-unit-sync")
def _sync_task(payload: Any) -> Any:
    for _ in range(3):
        metadata.increment("count")
    return metadata.current()


@pytest.fixture
async def channel() -> AsyncIterator[Channel]:
    parent, child = mp.Pipe()
    ch = Channel(child, asyncio.get_running_loop())
    try:
        yield ch
    finally:
        ch.close()
        parent.close()
        child.close()


_API_URL = os.environ.get("RUN_ENGINE_API_URL")


def _restore_env() -> None:
    os.environ.pop("RUN_ENGINE_RUN_TOKEN", None)
    if _API_URL is None:
        os.environ.pop("RUN_ENGINE_API_URL", None)
    else:
        os.environ["RUN_ENGINE_API_URL"] = _API_URL


def _msg(task_id: str, payload: Any, metadata: Any = None) -> dict[str, Any]:
    return {"type": "run", "runId": "run_1", "task": task_id, "payload": payload, "attempt": 1, "tags": [],
            "queue": "q", "runToken": "rt", "apiUrl": "http://127.0.0.1:1", "journal": [], "metadata": metadata}


async def test_the_executor_sends_the_changes_before_the_attempt_completes(server: _Server, channel: Channel,
                                                                           ) -> None:
    try:
        result = await _run_one(_msg("metadata-unit-async", "ok", {"seed": 1}), channel)
        assert result == {"ok": True, "output": {"seed": 1, "stage": "done"}}
        assert server.bodies == [{"operations": [{"type": "set", "key": "stage", "value": "done"}],
                                  "parentOperations": [{"type": "increment", "key": "children", "value": 1}],
                                  "rootOperations": []}]
        failed = await _run_one(_msg("metadata-unit-async", "fail"), channel)
        assert failed["ok"] is False and "failed after its changes" in failed["error"]["message"]
        assert len(server.bodies) == 2  # a failing attempt's changes are sent too
        # a sync task changes its metadata from its thread
        assert (await _run_one(_msg("metadata-unit-sync", None), channel))["output"] == {"count": 3}
        assert server.bodies[2]["operations"] == [{"type": "increment", "key": "count", "value": 3}]
        # a task that never touches its metadata: no request, nothing armed
        assert (await _run_one(_msg("metadata-unit-async", "none"), channel))["output"] == "untouched"
        assert len(server.bodies) == 3
        # nothing left behind to run during the executor's next run
        assert [t for t in asyncio.all_tasks() if "RunMetadata" in repr(t.get_coro())] == []
    finally:
        _restore_env()


async def test_an_attempt_completes_when_its_changes_cannot_be_sent(server: _Server, channel: Channel,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    server.fail = [TaskError(503, "unavailable", "down")] * 3 + [TaskError(413, "payload_too_large", "big")]
    try:
        with caplog.at_level(logging.WARNING, logger="run_engine.sdk.metadata"):
            assert (await _run_one(_msg("metadata-unit-async", "ok"), channel))["ok"]
            assert (await _run_one(_msg("metadata-unit-async", "ok"), channel))["ok"]
        messages = [r.getMessage() for r in caplog.records]
        assert "could not be sent and are lost" in messages[0] and "refused" in messages[1]
        assert server.bodies == []
    finally:
        _restore_env()
