"""A wait or trigger-and-wait call the engine cannot answer (a restart, PostgreSQL or Redis away)
is repeated with back-off until it can, within a bound; other answers come back at once."""

from __future__ import annotations

from typing import Any

from supervisor.executor import ExecutorPool
from supervisor.supervisor import Reply, Supervisor, SupervisorConfig


def supervisor(replies: list[Any], retry_s: float = 30.0) -> tuple[Supervisor, list[str]]:
    sup = Supervisor.__new__(Supervisor)
    sup.config = SupervisorConfig(api_url="http://x", token="t", tasks_module="m", wait_retry_s=retry_s)
    sup.pool = ExecutorPool("m")  # no process until one is acquired
    sup._lent = 0
    calls: list[str] = []

    async def post(path: str, json: Any = None) -> Reply:
        calls.append(path)
        answer = replies.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    sup._post = post  # type: ignore[method-assign]
    return sup, calls


async def test_repeats_while_unavailable_then_returns_the_answer() -> None:
    ok = Reply(200, {"blocked": True}, "")
    sup, calls = supervisor([Reply(503, None, ""), OSError("refused"), Reply(502, None, ""), ok])
    # the answer, marked as one that came after tries that went unanswered (they may have been done)
    assert await sup._post_until_answered("/runs/r/snapshots/s/trigger", {"sequence": 0}) == Reply(
        200, {"blocked": True}, "", retried=True)
    assert len(calls) == 4


async def test_an_answer_that_is_not_an_outage_is_not_repeated() -> None:
    refused = Reply(409, {"error": {"message": "stale"}}, "")
    sup, calls = supervisor([refused, Reply(200, {}, "")])
    assert await sup._post_until_answered("/p", {}) == refused and not refused.retried
    assert len(calls) == 1


async def test_gives_the_last_answer_once_the_bound_is_spent() -> None:
    sup, calls = supervisor([Reply(503, None, "")] * 5, retry_s=0.0)
    assert (await sup._post_until_answered("/p", {})).status == 503
    assert len(calls) == 1


async def test_a_repeated_journal_call_refused_as_a_duplicate_of_itself_is_accepted() -> None:
    """The first call got through but its answer was lost (503 after the commit, or the
    connection dropped): the repeat is refused (409), and the journal holds what we sent."""
    from supervisor.supervisor import RunState

    sup, calls = supervisor([OSError("reset"), Reply(409, {"error": {"message": "duplicate"}}, "")])

    class Http:
        async def get(self, path: str) -> Reply:
            calls.append(path)
            return Reply(200, {"journal": [{"sequence": 3, "kind": "step", "key": "a", "resolved": True,
                                             "result": {"v": 1}}]}, "")

    sup.http = Http()  # type: ignore[assignment]
    state = RunState.__new__(RunState)
    state.run_id, state.snapshot_id = "run_x", "snapshot_y"
    assert await sup._journal(state, {"sequence": 3, "key": "a", "result": {"v": 1}}) == {}
    other, _ = supervisor([Reply(409, {"error": {"message": "duplicate"}}, "")])
    assert (await other._journal(state, {"sequence": 3, "key": "a", "result": {"v": 2}}))["duplicate"]


async def test_a_run_that_blocks_suspends_at_once_only_while_runs_queue_for_the_slots() -> None:
    import asyncio

    sup, _ = supervisor([])
    sup._slots = asyncio.Semaphore(2)
    sup._backlog, sup._gathering = True, False
    await sup._slots.acquire()
    assert not sup._suspend_at_once()  # a slot is free and nobody is taking it: the grace period applies
    sup._gathering = True  # the free slot is being gathered for the next dequeue of the queued runs
    assert sup._suspend_at_once()
    sup._gathering = False
    sup._lent = 1  # the free slot is one a run being suspended lent to the next dequeue
    assert sup._suspend_at_once()
    sup._lent = 0
    await sup._slots.acquire()
    assert sup._suspend_at_once()  # every slot busy
    sup._backlog = False
    assert not sup._suspend_at_once()  # nothing queues for them


async def test_concurrent_waits_go_in_one_request_and_a_wait_not_answered_is_repeated() -> None:
    import asyncio

    from run_engine.batching import Batcher

    sup, calls = supervisor([
        Reply(200, {"results": [{"ok": True, "blocked": True}, {"ok": False, "status": 503, "error": {}},
                                {"ok": False, "status": 409, "error": {"message": "stale"}}]}, ""),
        Reply(503, None, "busy"),  # the whole request (a restart): repeated too
        Reply(200, {"results": [{"ok": True, "blocked": False}]}, "")])
    sup._waits = Batcher(sup._wait_many, max_batch=100)
    sent: list[Any] = []
    post = sup._post

    async def recording(path: str, json: Any = None) -> Reply:
        sent.append(json)
        return await post(path, json)

    sup._post = recording  # type: ignore[method-assign]
    item = {"snapshotId": "s", "waitpointId": "waitpoint_1", "sequence": 0, "kind": "token"}
    first, second, third = await asyncio.gather(*(sup._wait_until_answered({"runId": f"run_{i}", **item})
                                                 for i in range(3)))
    assert calls == ["/waits"] * 3 and len(sent[0]["items"]) == 3  # the three in one request
    assert first.status == 200 and first.data["blocked"]
    assert second.status == 200 and second.data["blocked"] is False  # answered at its third try
    assert third.status == 409 and third.text == "stale"  # refused: not repeated
    assert [len(s["items"]) for s in sent] == [3, 1, 1]


async def test_a_supervisor_stopped_while_the_engine_never_answers_its_connect_stops() -> None:
    """An engine that takes the connection and never answers (a server hung at start): SIGTERM
    ends the supervisor at once instead of after its connect attempts."""
    import asyncio

    sup, calls = supervisor([])
    sup.config = SupervisorConfig(api_url="http://x", token="t", tasks_module="json")
    sup.name, sup._stopping, sup._inflight, sup._poll = "w", asyncio.Event(), set(), None
    closed: list[bool] = []

    class Http:
        async def close(self) -> None:
            closed.append(True)

    sup.http = Http()  # type: ignore[assignment]
    never, asked = asyncio.Event(), asyncio.Event()

    async def hang(path: str, json: Any = None) -> Reply:
        calls.append(path)
        asked.set()
        await never.wait()
        raise AssertionError("unreachable")

    sup._post = hang  # type: ignore[method-assign]
    running = asyncio.ensure_future(sup._run())
    await asyncio.wait_for(asked.wait(), 10)
    sup.stop()
    await asyncio.wait_for(running, 10)  # (a bound, not a timing: it returns as soon as it is told)
    assert calls == ["/connect"] and closed == [True]


async def test_a_batch_of_waits_refused_as_a_whole_is_split_so_that_only_the_bad_wait_fails() -> None:
    import asyncio

    from run_engine.batching import Batcher

    sup, calls = supervisor([])
    sup._waits = Batcher(sup._wait_many, max_batch=100)

    async def post(path: str, json: Any = None) -> Reply:
        calls.append(path)
        items = json["items"]
        if any(not i["waitpointId"] for i in items):  # the server checks the body as a whole
            return Reply(400, {"error": {"code": "invalid_input", "message": "items.0.waitpointId: too short"}}, "")
        return Reply(200, {"results": [{"ok": True, "blocked": True} for _ in items]}, "")

    sup._post = post  # type: ignore[method-assign]
    item = {"snapshotId": "s", "sequence": 0, "kind": "token"}
    answers = await asyncio.gather(*(sup._wait_until_answered({"runId": f"run_{i}", **item,
                                                                "waitpointId": "" if i == 2 else "waitpoint_1"})
                                     for i in range(4)))
    assert [a.status for a in answers] == [200, 200, 400, 200]
    assert answers[2].text == "items.0.waitpointId: too short"
    assert len(calls) <= 1 + 2 + 2  # the whole batch, then halves (then the bad half's halves)


async def test_a_wait_refused_after_an_unanswered_try_that_got_through_is_taken_as_done() -> None:
    """The first POST /waits was done but its answer lost (a 503 after the commit): the repeat is
    refused as stale (409). The journal holds this very wait and the run is SUSPENDED: the
    executor is told to stop as after the first answer, not failed as a duplicate."""
    from run_engine.batching import Batcher
    from supervisor.supervisor import RunState

    sup, calls = supervisor([Reply(503, None, "lost"),
                             Reply(200, {"results": [{"ok": False, "status": 409, "error": {"message": "stale"}}]},
                                   "")])
    sup._waits = Batcher(sup._wait_many, max_batch=100)
    sup.config = SupervisorConfig(api_url="http://x", token="t", tasks_module="m", suspend_after_s=0)
    suspended_snapshot = {"id": "snapshot_2", "executionStatus": "SUSPENDED"}

    class Http:
        async def get(self, path: str) -> Reply:
            calls.append(path)
            if "/journal" in path:
                return Reply(200, {"journal": [{"sequence": 3, "kind": "token", "key": "waitpoint_1",
                                                "resolved": False, "waitpointId": "waitpoint_1"}]}, "")
            assert path == "/runs/run_1/snapshots/latest?since=snapshot_1"
            return Reply(200, {"snapshot": suspended_snapshot, "sameExecution": True}, "")

    class Executor:
        stopped = False

        def suspend(self) -> None:
            self.stopped = True

    sup.http = Http()  # type: ignore[assignment]
    executor = Executor()
    state = RunState("run_1", "snapshot_1")
    msg = {"op": "wait", "sequence": 3, "kind": "token", "waitpointId": "waitpoint_1"}
    assert await sup._wait(state, executor, msg) is None
    assert executor.stopped and state.snapshot_id == "snapshot_2"
    assert calls == ["/waits", "/waits", "/runs/run_1/journal?from=3", "/runs/run_1/snapshots/latest?since=snapshot_1"]
    # another execution's wait at that sequence (another waitpoint): still a duplicate
    sup2, _ = supervisor([Reply(503, None, "lost"),
                          Reply(200, {"results": [{"ok": False, "status": 409, "error": {"message": "stale"}}]},
                                "")])
    sup2._waits = Batcher(sup2._wait_many, max_batch=100)
    sup2.config = sup.config
    sup2.http = Http()  # type: ignore[assignment]
    other = {**msg, "waitpointId": "waitpoint_9"}
    assert (await sup2._wait(RunState("run_1", "snapshot_1"), Executor(), other))["duplicate"]  # type: ignore[index]


async def test_a_wait_refused_after_a_lost_answer_is_not_taken_as_ours_once_the_run_was_restored() -> None:
    """The lost try got through, then the run was suspended and restored on another executor
    (EXECUTING again, same attempt): the engine says the moves since are not this execution's,
    that execution is the run's, and this one stops (a duplicate). Continued in place (the engine
    says its own), the wait's outcome is taken as the answer; an engine that cannot say (an older
    server) is answered as before, by the attempt number and the checkpoint."""
    from run_engine.batching import Batcher
    from supervisor.supervisor import RunState

    async def after_lost_answer(latest: dict[str, Any], same: bool | None) -> dict[str, Any] | None:
        sup, _ = supervisor([Reply(503, None, "lost"), Reply(200, {"results": [
            {"ok": False, "status": 409, "error": {"message": "stale"}}]}, "")])
        sup._waits = Batcher(sup._wait_many, max_batch=100)
        sup.config = SupervisorConfig(api_url="http://x", token="t", tasks_module="m", suspend_after_s=0)

        class Http:
            async def get(self, path: str) -> Reply:
                if "/journal" in path:
                    return Reply(200, {"journal": [{"sequence": 3, "kind": "token", "key": "waitpoint_1",
                                                    "resolved": True, "result": {"ok": True, "output": 1},
                                                    "waitpointId": "waitpoint_1"}]}, "")
                if path == "/runs/run_1/snapshots/latest":  # an older engine's fallback
                    assert same is None
                    return Reply(200, {"snapshot": latest}, "")
                assert path == "/runs/run_1/snapshots/latest?since=snapshot_1"
                return Reply(200, {"snapshot": latest, **({} if same is None else {"sameExecution": same})}, "")

        class Executor:
            def suspend(self) -> None:
                raise AssertionError("not suspended: the run executes")

        sup.http = Http()  # type: ignore[assignment]
        sup.pool.not_returning = lambda executor: None  # type: ignore[method-assign]
        state = RunState("run_1", "snapshot_1", attempt=1)
        return await sup._wait(state, Executor(), {"op": "wait", "sequence": 3, "kind": "token",
                                                   "waitpointId": "waitpoint_1"})

    restored = {"id": "snapshot_9", "executionStatus": "EXECUTING", "attemptNumber": 1,
                "checkpointId": "checkpoint_1", "previousSnapshotId": "snapshot_8"}
    assert (await after_lost_answer(restored, False) or {}).get("duplicate") is True
    in_place = {**restored, "checkpointId": None, "previousSnapshotId": "snapshot_2"}
    assert await after_lost_answer(in_place, True) == {"result": {"ok": True, "output": 1}}
    # an engine older than sameExecution: told as before, by the attempt and the checkpoint
    assert await after_lost_answer(in_place, None) == {"result": {"ok": True, "output": 1}}
    assert (await after_lost_answer(restored, None) or {}).get("duplicate") is True
    assert (await after_lost_answer({**in_place, "attemptNumber": 2}, None) or {}).get("duplicate") is True


async def test_connect_is_repeated_while_the_engine_cannot_serve_and_not_when_it_refuses() -> None:
    """A 503 (the engine's Redis or PostgreSQL away for a moment) does not end the supervisor: the
    connect is repeated like an unreachable engine; a refusal (400) ends it at once."""
    import pytest

    connected = {"deploymentId": "d", "version": "1", "deployments": [{"environmentId": "e", "deploymentId": "d"}]}
    sup, calls = supervisor([Reply(503, None, ""), OSError("refused"), Reply(200, connected, "")])
    sup.config = SupervisorConfig(api_url="http://x", token="t", tasks_module="json")
    sup.name, sup._deployments = "w", []
    assert await sup.connect() == connected
    assert calls == ["/connect"] * 3 and sup._deployments == ["d"]
    refused, calls = supervisor([Reply(400, {"error": {"message": "bad"}}, "bad deployment")])
    refused.config, refused.name = sup.config, "w"
    with pytest.raises(SystemExit, match="connect failed: 400"):
        await refused.connect()
    assert calls == ["/connect"]


async def test_a_heartbeat_the_engine_did_not_answer_is_tried_again_soon(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Refused for load (429) or lost, a heartbeat is tried again after HEARTBEAT_RETRY_S, not a whole
    interval later: three intervals missed, the run would be taken for stalled and run twice."""
    import asyncio

    import supervisor.supervisor as module
    from supervisor.supervisor import HEARTBEAT_RETRY_S, RunState

    sup, calls = supervisor([Reply(429, None, "busy"), OSError("lost"), Reply(200, {}, ""),
                             Reply(200, {}, ""), Reply(409, {"error": {"latestSnapshot": {
                                 "executionStatus": "FINISHED"}}}, "")])
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(module.asyncio, "sleep", sleep)
    await asyncio.wait_for(sup._run_heartbeats(RunState("run_1", "snapshot_1"), None), 5)
    interval = sup.config.heartbeat_interval_s
    assert slept == [HEARTBEAT_RETRY_S, HEARTBEAT_RETRY_S, interval, interval] and len(calls) == 5


async def test_an_engine_never_reached_ends_the_supervisor_with_a_message(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """60 connects that never reach the engine end the supervisor with one line naming it (exit 1),
    not the last transport error's traceback."""
    import pytest

    import supervisor.supervisor as module

    async def no_wait(seconds: float) -> None:
        return None

    monkeypatch.setattr(module.asyncio, "sleep", no_wait)
    sup, calls = supervisor([OSError("connection refused")] * 60)
    sup.config = SupervisorConfig(api_url="http://engine:3030", token="t", tasks_module="json")
    sup.name, sup._deployments = "w", []
    with pytest.raises(SystemExit) as stopped:
        await sup.connect()
    assert calls == ["/connect"] * 60
    assert str(stopped.value).startswith("error: cannot reach the engine at http://engine:3030 after 60 attempts")
