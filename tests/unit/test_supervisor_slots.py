"""A run gives its supervisor slot back when its executor is done, before its completion is
answered, so that the next dequeue overlaps the report; no more than `concurrency` completions
wait for an answer so, after which a finished run keeps its slot."""

from __future__ import annotations

import asyncio
from typing import Any

from supervisor.supervisor import Supervisor, SupervisorConfig


class Executor:
    async def run(self, msg: dict[str, Any], **_: Any) -> dict[str, Any]:
        return {"ok": True, "output": msg["runId"]}


class Pool:
    def __init__(self) -> None:
        self.busy = 0

    async def acquire(self, memory_mb: int | None = None) -> Executor:
        self.busy += 1
        return Executor()

    def release(self, _: Executor) -> None:
        self.busy -= 1

    async def warm(self, n: int) -> None:
        return None

    def close(self) -> None:
        return None


class Completions:
    """Completions that wait for the test to answer them."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.answer = asyncio.Event()

    async def submit(self, item: dict[str, Any]) -> dict[str, Any]:
        self.sent.append(item["runId"])
        await self.answer.wait()
        return {"ok": True}


def item(run_id: str) -> dict[str, Any]:
    return {"run": {"id": run_id}, "snapshot": {"id": f"snapshot_{run_id}"},
            "attempt": {"ok": True, "snapshot": {"id": f"snapshot_{run_id}"}, "attemptNumber": 1,
                        "payload": {}, "runToken": "t",
                        "run": {"taskIdentifier": "noop", "tags": [], "queue": "task/noop"}}}


async def handed(sup: Supervisor, run: dict[str, Any]) -> asyncio.Task[None]:
    """A dequeued run handed to its slot, as the run loop does."""
    await sup._slots.acquire()
    sup._executing += 1
    sup._none_executing.clear()
    return asyncio.create_task(sup._handle(run))


async def until(predicate: Any) -> None:
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("not reached")


async def test_a_finished_run_frees_its_slot_while_its_completion_is_on_its_way() -> None:
    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json", concurrency=1))
    sup.pool = Pool()  # type: ignore[assignment]
    completions = sup._completions = Completions()  # type: ignore[assignment]
    try:
        first = await handed(sup, item("run_1"))
        await until(lambda: completions.sent == ["run_1"])
        assert not sup._slots.locked()  # the slot is back while run_1's completion waits
        assert sup.pool.busy == 0

        second = await handed(sup, item("run_2"))
        await until(lambda: sup.pool.busy == 0)
        await asyncio.sleep(0.01)
        # one completion (the concurrency) already waits: run_2 keeps its slot until it can report
        assert completions.sent == ["run_1"] and sup._slots.locked()

        completions.answer.set()
        await asyncio.wait_for(asyncio.gather(first, second), 5)
        assert completions.sent == ["run_1", "run_2"] and sup.completed == 2
        assert not sup._slots.locked() and sup._slots._value == 1  # each slot released exactly once
    finally:
        await sup.http.close()


async def test_a_run_that_fails_before_its_executor_returns_its_slot_once(monkeypatch: Any) -> None:
    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json", concurrency=2,
                                      heartbeat_interval_s=0.05))
    beats: list[str] = []

    async def heartbeat(state: Any, executor: Any) -> bool:
        beats.append(state.run_id)
        return False

    monkeypatch.setattr(sup, "_heartbeat", heartbeat)

    class Broken(Pool):
        async def acquire(self, memory_mb: int | None = None) -> Executor:
            raise RuntimeError("no executor")

    sup.pool = Broken()  # type: ignore[assignment]
    completions = sup._completions = Completions()  # type: ignore[assignment]
    completions.answer.set()
    reported: list[dict[str, Any]] = []
    submit = completions.submit

    async def record(item: dict[str, Any]) -> dict[str, Any]:
        reported.append(item)
        return await submit(item)

    completions.submit = record  # type: ignore[method-assign]
    try:
        await (await handed(sup, item("run_1")))  # logged, not raised
        assert sup._slots._value == 2 and sup._executing == 0
        # reported at once as a retryable failure, not left EXECUTING until taken for stalled
        (failure,) = reported
        assert failure["runId"] == "run_1" and failure["ok"] is False and failure["retryable"] is True
        assert failure["error"]["type"] == "TASK_PROCESS_START_FAILED" and "no executor" in failure["error"]["message"]
        assert beats  # the run's heartbeats went on during the back-off (0.5 s): not taken for stalled
    finally:
        await sup.http.close()


async def test_a_dequeue_gathering_freed_slots_goes_once_no_run_holds_one(monkeypatch: Any) -> None:
    """While runs queue for the slots, a freed slot waits for the others (DEQUEUE_GATHER_S), but no
    longer than until every run has given its slot back. Made an hour long here: the second
    dequeue still comes, for both slots."""
    from supervisor import supervisor as module

    monkeypatch.setattr(module, "DEQUEUE_GATHER_S", 3600.0)
    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json", concurrency=2))
    sup.pool = Pool()  # type: ignore[assignment]

    class Answered(Completions):
        async def submit(self, item: dict[str, Any]) -> dict[str, Any]:
            self.sent.append(item["runId"])
            return {"ok": True}

    sup._completions = Answered()  # type: ignore[assignment]
    asked: list[int] = []

    async def dequeue(max_runs: int) -> list[dict[str, Any]]:
        asked.append(max_runs)
        if len(asked) == 1:
            sup._backlog = True
            return [item("run_1"), item("run_2")]
        sup.stop()
        return []

    sup._dequeue = dequeue  # type: ignore[method-assign]
    sup._connect_unless_stopped = lambda: _true()  # type: ignore[method-assign]
    await asyncio.wait_for(sup._run(), 10)
    assert asked == [2, 2]  # the second dequeue took both freed slots, without the hour's wait
    assert sup.completed == 2


async def _true() -> bool:
    return True


class Returning:
    """An executor, as the pool sees it, stopping its suspended run."""

    alive = True
    retired = False

    def kill(self) -> None:
        self.alive = False


class New(Returning):
    """An executor the pool starts (instead of forking one)."""

    def __init__(self, tasks: str) -> None:
        pass

    async def ready(self) -> None:
        return None


async def test_a_run_waits_for_an_executor_on_its_way_back_instead_of_starting_one(monkeypatch: Any) -> None:
    from supervisor import executor as module

    started: list[str] = []
    monkeypatch.setattr(module, "Executor", lambda tasks: started.append(tasks))  # would fork one
    pool = module.ExecutorPool("m")
    back: Any = Returning()
    pool.busy = 1
    pool.returning(back)
    waiting = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0.01)
    assert not waiting.done() and started == []
    pool.release(back)
    assert await asyncio.wait_for(waiting, 5) is back and started == [] and pool.busy == 1


async def test_only_one_run_waits_for_each_executor_coming_back_and_none_for_a_late_one(monkeypatch: Any) -> None:
    """Two runs, one executor coming back: the first waits for it, the second starts one at once.
    An executor not back within RETURN_WAIT_S (a task that ignores its cancel: another tenant's
    code) makes no run wait again: one tenant's task cannot stall the others' starts."""
    from supervisor import executor as module

    monkeypatch.setattr(module, "Executor", New)
    monkeypatch.setattr(module, "RETURN_WAIT_S", 3600.0)
    pool = module.ExecutorPool("m")
    back: Any = Returning()
    pool.returning(back)
    first = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0.01)
    second = await asyncio.wait_for(pool.acquire(), 5)  # started at once: back is the first run's
    assert isinstance(second, New) and pool.started == 1 and not first.done()
    pool.release(back)
    assert await asyncio.wait_for(first, 5) is back and pool.started == 1

    stuck: Any = Returning()
    pool.returning(stuck)
    monkeypatch.setattr(module, "RETURN_WAIT_S", 0.05)
    waited = asyncio.create_task(pool.acquire())
    assert isinstance(await asyncio.wait_for(waited, 5), New) and pool.started == 2  # waited, then started one
    late = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0)
    assert late.done() and isinstance(late.result(), New) and pool.started == 3  # no wait for a late one


async def test_a_suspended_run_gives_its_slot_back_before_its_executor_is_back() -> None:
    from supervisor.supervisor import RunState

    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json", concurrency=1))
    try:
        await sup._slots.acquire()
        sup._executing = 1
        stopping: Any = Returning()
        told: list[str] = []
        stopping.suspend = lambda: told.append("suspend")
        from supervisor.supervisor import _Slot

        state = RunState("run_1", "snapshot_1", slot=_Slot(sup._slot_freed))
        sup._suspend(state, stopping)
        assert told == ["suspend"] and not sup._slots.locked() and sup._executing == 0
        assert stopping in sup.pool._returning
        assert state.slot is not None
        state.slot.release()  # the run's end releases it again: nothing more is freed
        assert sup._slots._value == 1
    finally:
        await sup.http.close()


class Waits:
    """The supervisor's wait requests, answered when the test says; records whether the run's
    slot was free while each was asked."""

    def __init__(self, sup: Supervisor, answer: dict[str, Any]) -> None:
        self.sup, self.answer = sup, answer
        self.slot_free_while_asked: list[bool] = []
        self.go = asyncio.Event()

    async def submit(self, item: dict[str, Any]) -> dict[str, Any]:
        self.slot_free_while_asked.append(not self.sup._slots.locked())
        await self.go.wait()
        return self.answer


def suspending(answer: dict[str, Any]) -> tuple[Supervisor, Waits, Any, Any]:
    """A one-slot supervisor whose run holds the slot and blocks while runs queue for it."""
    from supervisor.supervisor import RunState, _Slot

    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json", concurrency=1))
    waits = Waits(sup, answer)
    sup._waits = waits  # type: ignore[assignment]
    sup._backlog = True
    executor: Any = Returning()
    executor.told = []
    executor.suspend = lambda: executor.told.append("suspend")
    state = RunState("run_1", "snapshot_1", slot=_Slot(sup._slot_freed, sup._slot_taken))
    return sup, waits, executor, state


async def test_a_run_asked_to_suspend_lends_its_slot_to_the_next_dequeue_while_its_wait_is_asked() -> None:
    suspended = {"ok": True, "blocked": True, "suspended": True, "snapshot": {"id": "snapshot_2"}}
    sup, waits, executor, state = suspending(suspended)
    try:
        await sup._slots.acquire()
        sup._executing = 1
        wait = asyncio.create_task(sup._wait(state, executor, {"sequence": 0, "kind": "token", "waitpointId": "wp"}))
        await until(lambda: waits.slot_free_while_asked == [True])
        assert executor in sup.pool._returning and sup._executing == 0 and sup._suspend_at_once()
        waits.go.set()
        assert await asyncio.wait_for(wait, 5) is None  # the executor is told to stop instead
        assert executor.told == ["suspend"] and sup._slots._value == 1 and sup._lent == 0
    finally:
        await sup.http.close()


async def test_a_run_whose_wait_is_over_takes_a_slot_again_before_its_task_goes_on() -> None:
    over = {"ok": True, "blocked": False, "snapshot": {"id": "snapshot_2"}, "entry": {"result": {"ok": True}}}
    sup, waits, executor, state = suspending(over)
    try:
        await sup._slots.acquire()
        sup._executing = 1
        wait = asyncio.create_task(sup._wait(state, executor, {"sequence": 0, "kind": "token", "waitpointId": "wp"}))
        await until(lambda: waits.slot_free_while_asked == [True])
        await sup._slots.acquire()  # the next dequeue took the lent slot for another run
        waits.go.set()
        await asyncio.sleep(0.01)
        assert not wait.done()  # the run goes on only once a slot is free again
        assert executor not in sup.pool._returning
        sup._slots.release()  # the other run is done
        assert await asyncio.wait_for(wait, 5) == {"result": {"ok": True}}
        assert sup._slots.locked() and sup._executing == 1 and state.snapshot_id == "snapshot_2"
        assert state.slot is not None
        state.slot.release()
        assert sup._slots._value == 1 and sup._executing == 0
    finally:
        await sup.http.close()


async def test_a_run_waiting_for_an_executor_that_keeps_its_run_after_all_starts_one(monkeypatch: Any) -> None:
    from supervisor import executor as module

    monkeypatch.setattr(module, "Executor", New)
    monkeypatch.setattr(module, "RETURN_WAIT_S", 3600.0)
    pool = module.ExecutorPool("m")
    lent: Any = Returning()
    pool.returning(lent)
    waiting = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    pool.not_returning(lent)  # its run was not suspended after all
    assert isinstance(await asyncio.wait_for(waiting, 5), New) and pool.started == 1


async def test_a_later_coroutine_is_a_timer_until_due_and_stops_either_way() -> None:
    from supervisor.supervisor import _Later

    started: list[str] = []
    ended = asyncio.Event()

    async def beat(name: str) -> None:
        started.append(name)
        try:
            await asyncio.sleep(3600)
        finally:
            ended.set()

    early = _Later(3600, lambda: beat("early"), "run_x", "beat")
    await early.stop()  # stopped before due: never started, no task made
    assert early._task is None and started == []

    due = _Later(0, lambda: beat("due"), "run_x", "beat")
    deadline = asyncio.get_running_loop().time() + 10
    while not started:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)
    await due.stop()  # started: cancelled and waited for
    assert started == ["due"] and ended.is_set() and due._task is not None and due._task.cancelled()


async def test_a_later_coroutine_that_failed_is_logged_and_a_cancelled_caller_stays_cancelled(caplog: Any) -> None:
    from supervisor.supervisor import _Later

    async def broken() -> None:
        raise AttributeError("'str' object has no attribute 'get'")

    failed = _Later(0, broken, "run_x", "heartbeats")
    await until(lambda: failed._task is not None and failed._task.done())
    with caplog.at_level("ERROR", logger="run_engine.supervisor"):
        await failed.stop()  # logged, not raised into the run
    assert "run run_x: its heartbeats failed" in caplog.text

    release = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await release.wait()  # ends only when the test says so

    slow = _Later(0, slow_to_stop, "run_x", "cancel watch")
    await until(lambda: slow._task is not None)
    await asyncio.sleep(0)
    stopping = asyncio.create_task(slow.stop())
    await asyncio.sleep(0.01)
    stopping.cancel()  # the caller of stop() is cancelled while it waits: it must not swallow that
    release.set()
    try:
        await stopping
    except asyncio.CancelledError:
        pass
    else:
        raise AssertionError("stop() swallowed its caller's cancellation")


async def test_a_run_whose_heartbeats_fail_keeps_beating_reports_stops_its_cancel_watch_and_frees_its_executor(
        monkeypatch: Any, caplog: Any) -> None:
    import supervisor.supervisor as supervisor_module

    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json", concurrency=1,
                                      heartbeat_interval_s=0.01))
    watch_ended = asyncio.Event()
    beats = 0

    class SlowExecutor(Executor):
        async def run(self, msg: dict[str, Any], **_: Any) -> dict[str, Any]:
            await until(lambda: beats > 2 and watch_started.is_set())  # both helpers ran meanwhile
            return {"ok": True, "output": msg["runId"]}

    class SlowPool(Pool):
        async def acquire(self, memory_mb: int | None = None) -> Executor:
            self.busy += 1
            return SlowExecutor()

    watch_started = asyncio.Event()

    async def heartbeat(state: Any, executor: Any) -> bool:
        nonlocal beats
        beats += 1
        raise AttributeError("'str' object has no attribute 'get'")  # an answer of an unexpected shape

    async def watch(state: Any, executor: Any) -> None:
        watch_started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            watch_ended.set()

    monkeypatch.setattr(supervisor_module, "CANCEL_WATCH_AFTER_S", 0.01)
    monkeypatch.setattr(sup, "_heartbeat", heartbeat)
    monkeypatch.setattr(sup, "_watch_cancel", watch)
    sup.pool = SlowPool()  # type: ignore[assignment]
    completions = sup._completions = Completions()  # type: ignore[assignment]
    completions.answer.set()
    try:
        with caplog.at_level("WARNING", logger="run_engine.supervisor"):
            await asyncio.wait_for(await handed(sup, item("run_1")), 5)
        assert beats > 2  # a failed heartbeat is followed by the next: the run is not taken for stalled
        assert completions.sent == ["run_1"] and sup.completed == 1  # the result is reported
        assert watch_ended.is_set()  # the cancel watch does not outlive its run
        assert sup.pool.busy == 0 and not sup._slots.locked()  # executor and slot are back
        assert "run run_1: a heartbeat failed" in caplog.text
    finally:
        await sup.http.close()


async def test_completions_over_the_request_limit_together_are_split_and_an_output_too_large_fails_its_run(
        monkeypatch: Any) -> None:
    from supervisor.supervisor import Reply

    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json", concurrency=4))
    sent: list[list[dict[str, Any]]] = []

    async def post(path: str, json: Any = None) -> Reply:
        assert path == "/attempts/complete"
        items = json["items"]
        sent.append(items)
        if len(items) > 1:  # together over the request limit
            return Reply(413, {"error": {"code": "payload_too_large", "message": "request body is larger"}}, "")
        results = [{"ok": False, "status": 413, "error": {"code": "payload_too_large", "message": "output: larger "
                                                          "than 3145728 bytes"}} if i.get("output") == "huge"
                   else {"ok": True, "action": "finished"} for i in items]
        return Reply(200, {"results": results}, "")

    monkeypatch.setattr(sup, "_post", post)
    try:
        def completion(run: str, output: str) -> dict[str, Any]:
            return {"runId": run, "snapshotId": f"s_{run}", "ok": True, "output": output}

        answers = await asyncio.wait_for(asyncio.gather(
            sup._complete("r1", completion("r1", "big")), sup._complete("r2", completion("r2", "big")),
            sup._complete("r3", completion("r3", "huge"))), 10)
        assert [a["ok"] for a in answers] == [True, True, True]
        assert len(sent[0]) == 3  # refused together, then split in halves down to one run each
        alone = [items[0] for items in sent if len(items) == 1]
        assert [i["runId"] for i in alone if i["ok"]] == ["r1", "r2", "r3"]
        r3 = [i for i in alone if i["runId"] == "r3"]
        assert len(r3) == 2 and r3[-1]["ok"] is False and r3[-1]["retryable"] is False  # fails, not retried
        assert r3[-1]["error"]["type"] == "OUTPUT_TOO_LARGE" and "3145728" in r3[-1]["error"]["message"]
    finally:
        await sup.http.close()


def blocked_run(suspend_after_s: float) -> tuple[Supervisor, Any, Any]:
    """A one-slot supervisor, a stand-in executor that records what it is told, and a run's state."""
    from supervisor.supervisor import RunState

    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json", concurrency=1,
                                      suspend_after_s=suspend_after_s))
    executor: Any = Returning()
    executor.told = []
    executor.suspend = lambda: executor.told.append("suspend")
    executor.kill = lambda: executor.told.append("kill")
    sup.pool = Pool()  # type: ignore[assignment]
    sup.pool.returning = lambda ex: None  # type: ignore[attr-defined]
    return sup, executor, RunState("run_1", "snapshot_1", attempt=1)


async def test_an_engine_away_when_a_blocked_run_is_to_be_suspended_is_waited_out(monkeypatch: Any) -> None:
    from supervisor.supervisor import Reply

    sup, executor, state = blocked_run(0.01)
    blocked = Reply(200, {"blocked": True, "snapshot": {"id": "snapshot_2"}}, "")
    suspends: list[str] = []

    async def ask_wait(state: Any, msg: Any, suspend: bool) -> Reply:
        return blocked

    async def post(path: str, json: Any = None) -> Reply:
        suspends.append(path)
        if len(suspends) == 1:
            raise ConnectionRefusedError("the server restarts")
        return Reply(200, {}, "")

    async def latest(run_id: str, after: Any = None, wait_ms: int = 0) -> Any:
        return None  # the engine is away: looked at again

    monkeypatch.setattr(sup, "_ask_wait", ask_wait)
    monkeypatch.setattr(sup, "_post", post)
    monkeypatch.setattr(sup, "_latest", latest)
    try:
        answer = await asyncio.wait_for(sup._wait(state, executor, {"sequence": 0, "kind": "token",
                                                                   "waitpointId": "waitpoint_1"}), 10)
        assert answer is None and executor.told == ["suspend"]  # suspended at the second try, not failed
        assert suspends == ["/runs/run_1/snapshots/snapshot_2/suspend"] * 2
    finally:
        await sup.http.close()


async def test_a_suspend_whose_answer_was_lost_is_seen_in_the_run_s_snapshot(monkeypatch: Any) -> None:
    from supervisor.supervisor import Reply

    sup, executor, state = blocked_run(0.01)

    async def ask_wait(state: Any, msg: Any, suspend: bool) -> Reply:
        return Reply(200, {"blocked": True, "snapshot": {"id": "snapshot_2"}}, "")

    async def post(path: str, json: Any = None) -> Reply:
        raise TimeoutError("the answer was lost")  # the suspension was made all the same

    async def latest(run_id: str, after: Any = None, wait_ms: int = 0) -> Any:
        return {"id": "snapshot_3", "executionStatus": "SUSPENDED"}

    monkeypatch.setattr(sup, "_ask_wait", ask_wait)
    monkeypatch.setattr(sup, "_post", post)
    monkeypatch.setattr(sup, "_latest", latest)
    try:
        answer = await asyncio.wait_for(sup._wait(state, executor, {"sequence": 0, "kind": "token",
                                                                   "waitpointId": "waitpoint_1"}), 10)
        # told to stop as suspended (restored later by replay), not killed as if cancelled
        assert answer is None and executor.told == ["suspend"] and state.snapshot_id == "snapshot_3"
        assert not state.cancelled
    finally:
        await sup.http.close()


async def test_a_call_of_the_task_that_fails_unexpectedly_is_answered_with_the_error() -> None:
    from supervisor.supervisor import RunState

    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json", concurrency=1))
    replies: list[tuple[int, dict[str, Any]]] = []
    executor: Any = Returning()
    executor.reply = lambda call_id, data: replies.append((call_id, data))
    try:
        # a journal call without its key: the task waits for an answer, which must come
        await sup._on_call(RunState("run_1", "snapshot_1"), executor, {"id": 7, "op": "journal", "sequence": 0})
        assert len(replies) == 1 and replies[0][0] == 7 and "could not handle the call" in replies[0][1]["error"]
    finally:
        await sup.http.close()


async def test_a_duration_wait_whose_answer_was_lost_is_found_in_the_journal_not_taken_for_a_duplicate(
        monkeypatch: Any) -> None:
    from supervisor.supervisor import Reply, RunState

    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json", concurrency=1))
    tries: list[str] = []
    latest_attempt = 2

    async def post(path: str, json: Any = None) -> Reply:
        tries.append(path)
        if len(tries) == 1:
            raise TimeoutError("the answer was lost")  # the wait was made all the same: S1 -> S2
        return Reply(409, {"error": {"code": "conflict", "message": "stale snapshot"}}, "stale snapshot")

    async def get(path: str) -> Reply:
        assert path == "/runs/run_1/journal?from=3"
        return Reply(200, {"journal": [{"sequence": 3, "kind": "wait", "key": "3", "resolved": False,
                                        "waitpointId": "waitpoint_d"}]}, "")

    async def latest_since(state: Any, held: str) -> Any:  # the engine's sameExecution: our attempt's moves
        assert held == "snapshot_1"
        return ({"id": "snapshot_2", "executionStatus": "EXECUTING_WITH_WAITPOINTS", "attemptNumber": latest_attempt},
                latest_attempt == 2)

    monkeypatch.setattr(sup, "_post", post)
    monkeypatch.setattr(sup.http, "get", get)
    monkeypatch.setattr(sup, "_latest_since", latest_since)
    monkeypatch.setattr("supervisor.supervisor.random.random", lambda: 0.0)
    try:
        msg = {"sequence": 3, "kind": "wait", "seconds": 30}
        reply = await sup._ask_wait(RunState("run_1", "snapshot_1", attempt=2), msg, False)
        assert reply.status == 200 and reply.data["blocked"] and reply.data["snapshot"]["id"] == "snapshot_2"
        assert tries == ["/runs/run_1/snapshots/snapshot_1/wait/duration"] * 2
        # the same journal entry but another attempt running: not ours, the 409 stands (a duplicate)
        latest_attempt = 3
        tries.clear()
        reply = await sup._ask_wait(RunState("run_1", "snapshot_1", attempt=2), msg, False)
        assert reply.status == 409
    finally:
        await sup.http.close()


async def test_an_execution_taken_for_stalled_stops_once_another_attempt_runs(monkeypatch: Any) -> None:
    from supervisor.supervisor import Reply, RunState

    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json", concurrency=1))
    executor: Any = Returning()
    killed: list[bool] = []
    executor.kill = lambda: killed.append(True)
    running = {"attemptNumber": 2}

    async def post(path: str, json: Any = None) -> Reply:  # the snapshot moved on while we were away
        return Reply(409, {"error": {"code": "conflict", "latestSnapshot": {
            "id": "snapshot_9", "executionStatus": "EXECUTING"}}}, "")

    async def latest_since(state: Any, held: str) -> Any:  # the engine's sameExecution: our attempt's moves
        return {"id": "snapshot_9", "executionStatus": "EXECUTING", **running}, running["attemptNumber"] == 2

    monkeypatch.setattr(sup, "_post", post)
    monkeypatch.setattr(sup, "_latest_since", latest_since)
    try:
        state = RunState("run_1", "snapshot_1", attempt=2)
        assert await sup._heartbeat(state, executor) is False and killed == []  # our attempt: a wait moved it
        running["attemptNumber"] = 3  # the run was failed as stalled and its next attempt started elsewhere
        assert await sup._heartbeat(state, executor) is True and killed == [True] and state.cancelled
    finally:
        await sup.http.close()


async def test_against_an_older_engine_an_execution_taken_for_stalled_still_stops(monkeypatch: Any) -> None:
    """An engine older than ``sameExecution`` cannot say whose the moves are: the attempt number
    tells, as before (a retry elsewhere stops this execution)."""
    from supervisor.supervisor import Reply, RunState

    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json", concurrency=1))
    executor: Any = Returning()
    killed: list[bool] = []
    executor.kill = lambda: killed.append(True)
    running = {"attemptNumber": 2}

    async def post(path: str, json: Any = None) -> Reply:
        return Reply(409, {"error": {"code": "conflict", "latestSnapshot": {
            "id": "snapshot_9", "executionStatus": "EXECUTING"}}}, "")

    async def latest_since(state: Any, held: str) -> Any:
        return None, None  # the older engine: no sameExecution in its answer

    async def latest(run_id: str, after: Any = None, wait_ms: int = 0) -> Any:
        return {"id": "snapshot_9", "executionStatus": "EXECUTING", **running}

    monkeypatch.setattr(sup, "_post", post)
    monkeypatch.setattr(sup, "_latest_since", latest_since)
    monkeypatch.setattr(sup, "_latest", latest)
    try:
        state = RunState("run_1", "snapshot_1", attempt=2)
        assert await sup._heartbeat(state, executor) is False and killed == []
        running["attemptNumber"] = 3
        assert await sup._heartbeat(state, executor) is True and killed == [True]
    finally:
        await sup.http.close()


async def test_a_dequeue_answer_of_an_unexpected_shape_does_not_end_the_poll_loop(monkeypatch: Any) -> None:
    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json", concurrency=1))
    sup.pool = Pool()  # type: ignore[assignment]
    calls = 0

    async def connect() -> bool:
        return True

    async def dequeue(max_runs: int) -> list[dict[str, Any]]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise KeyError("runs")  # a 200 without its runs
        sup._stopping.set()
        return []

    monkeypatch.setattr(sup, "_connect_unless_stopped", connect)
    monkeypatch.setattr(sup, "_dequeue", dequeue)
    monkeypatch.setattr("supervisor.supervisor.heap.settle", lambda: None)
    await asyncio.wait_for(sup._run(), 10)
    assert calls == 2  # polled again after the bad answer, then stopped as asked


async def test_an_item_refused_on_its_own_is_its_answer_and_the_others_are_not_sent_again(monkeypatch: Any) -> None:
    from supervisor.supervisor import Reply

    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json", concurrency=4))
    sent: list[list[str]] = []

    async def post(path: str, json: Any = None) -> Reply:
        items = json["items"]
        sent.append([i["runId"] for i in items])
        if path == "/attempts/complete":  # r1's output alone is over the payload limit: a 413 of its own
            return Reply(200, {"results": [
                {"ok": False, "status": 413, "error": {"message": "output: larger than 3145728 bytes"}}
                if i["runId"] == "r1" and i["ok"] else {"ok": True, "action": "finished"} for i in items]}, "")
        # /waits: r1's wait refused on its own (400), r2's applied
        return Reply(200, {"results": [
            {"ok": False, "status": 400, "error": {"message": "kind batch: waits only on the batch the run's "
                                                              "journal entry at this sequence holds"}}
            if i["runId"] == "r1" else {"ok": True, "blocked": True, "snapshot": {"id": "s2"}} for i in items]}, "")

    monkeypatch.setattr(sup, "_post", post)
    try:
        answers = await asyncio.wait_for(asyncio.gather(*(
            sup._complete(r, {"runId": r, "snapshotId": f"s_{r}", "ok": True, "output": 1}) for r in ("r1", "r2"))), 10)
        assert [a["ok"] for a in answers] == [True, True]
        assert sent == [["r1", "r2"], ["r1"]]  # r2 once; r1 again alone, as its failure
        sent.clear()
        results = await asyncio.wait_for(asyncio.gather(*(sup._waits.submit(
            {"runId": r, "snapshotId": f"s_{r}", "waitpointId": "w", "sequence": 0, "kind": "token"})
            for r in ("r1", "r2"))), 10)
        assert [r.get("status") for r in results] == [400, None] and sent == [["r1", "r2"]]  # r2 not sent again
    finally:
        await sup.http.close()


async def test_a_failed_attempt_whose_error_is_too_large_is_reported_with_its_error_cut_down(monkeypatch: Any) -> None:
    from supervisor.supervisor import ERROR_KEPT_CHARS, Reply

    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json", concurrency=1))
    sent: list[dict[str, Any]] = []

    async def post(path: str, json: Any = None) -> Reply:
        (item,) = json["items"]
        sent.append(item)
        if len(item["error"]["stackTrace"]) > 1_000_000:
            return Reply(413, {"error": {"code": "payload_too_large", "message": "request body is larger"}}, "")
        return Reply(200, {"results": [{"ok": True, "action": "retry"}]}, "")

    monkeypatch.setattr(sup, "_post", post)
    try:
        huge = {"type": "BUILT_IN_ERROR", "name": "ValueError", "message": "m" * 100, "stackTrace": "t" * 11_000_000}
        answer = await asyncio.wait_for(sup._complete("r1", {"runId": "r1", "snapshotId": "s1", "ok": False,
                                                             "retryable": True, "error": huge}), 10)
        assert answer["ok"] and len(sent) == 2
        again = sent[1]
        assert again["ok"] is False and again["retryable"] is True and again["error"]["name"] == "ValueError"
        assert again["error"]["message"] == "m" * 100  # short fields kept as they were
        assert len(again["error"]["stackTrace"]) < ERROR_KEPT_CHARS + 100 and "11000000 characters" in \
            again["error"]["stackTrace"]
    finally:
        await sup.http.close()


async def test_a_run_restored_elsewhere_while_this_execution_waited_out_an_outage_is_not_adopted(
        monkeypatch: Any) -> None:
    from supervisor.supervisor import Reply

    sup, executor, state = blocked_run(30)

    async def ask_wait(state: Any, msg: Any, suspend: bool) -> Reply:
        return Reply(200, {"blocked": True, "snapshot": {"id": "snapshot_2"}}, "")

    async def latest(run_id: str, after: Any = None, wait_ms: int = 0) -> Any:
        # suspended by the engine, queued, restored and executing on another worker
        return {"id": "snapshot_6", "executionStatus": "EXECUTING", "previousSnapshotId": "snapshot_5",
                "attemptNumber": 1}

    monkeypatch.setattr(sup, "_ask_wait", ask_wait)
    monkeypatch.setattr(sup, "_latest", latest)
    try:
        answer = await asyncio.wait_for(sup._wait(state, executor, {"sequence": 0, "kind": "token",
                                                                   "waitpointId": "w"}), 10)
        assert answer is None and executor.told == ["kill"]  # this execution stops; the other is the run's
    finally:
        await sup.http.close()


class Refusing:
    """Completions the engine cannot take (503) until ``taken`` is set; each try recorded with
    whether the supervisor had been told to stop by then."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.tries: list[tuple[str, bool]] = []
        self.taken = False
        self.taken_of: set[str] = set()  # runs whose completion is taken already

    async def submit(self, item: dict[str, Any]) -> dict[str, Any]:
        self.tries.append((item["runId"], self.sup._stopping.is_set()))
        if self.taken or item["runId"] in self.taken_of:
            return {"ok": True}
        return {"ok": False, "status": 503, "error": {"code": "service_unavailable"}}


def quick_retries(monkeypatch: Any) -> None:
    import supervisor.supervisor as supervisor_module

    monkeypatch.setattr(supervisor_module, "COMPLETION_RETRY_FIRST_S", 0.001, raising=False)
    monkeypatch.setattr(supervisor_module, "COMPLETION_RETRY_MAX_S", 0.002, raising=False)


async def test_a_completion_is_retried_past_its_old_deadline_until_the_engine_answers_it(monkeypatch: Any) -> None:
    """Unreachable, 429 and 5xx are no answer: the result is held and sent again, however long
    (completion_retry_s bounds it only once the supervisor stops); 409 (the run moved on) is one."""
    quick_retries(monkeypatch)
    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json", completion_retry_s=0))
    answers: list[dict[str, Any]] = [{"ok": False, "status": s, "error": {}} for s in (503, 0, 429, 502, 500, 504)] + [
        {"ok": False, "status": 409, "error": {"message": "stale"}}, {"ok": True}]
    sent: list[str] = []

    class Answering:
        async def submit(self, item: dict[str, Any]) -> dict[str, Any]:
            sent.append(item["runId"])
            return answers.pop(0)

    sup._completions = Answering()  # type: ignore[assignment]
    try:
        answer = await asyncio.wait_for(sup._complete("run_1", {"runId": "run_1", "snapshotId": "s", "ok": True}), 10)
        assert answer["status"] == 409 and sent == ["run_1"] * 7  # the first answer, after six tries without
        assert sup.completions_pending == 0 and sup.completions_lost == []
    finally:
        await sup.http.close()


async def test_a_completion_answered_500_for_too_long_is_reported_as_a_retryable_failure_then_given_up(
        monkeypatch: Any, caplog: Any) -> None:
    """The engine answering one result 500 on every try (an error of its own on that result; 503
    is unavailability and is held for however long) no longer keeps the run EXECUTING for good:
    after completion_refused_s of 500s in a row the attempt is reported as failed
    (COMPLETION_REFUSED, retryable, without the output); that refused as long too, it is given
    up, so that the run's heartbeat timeout retries it. A 503 between resets the count."""
    quick_retries(monkeypatch)
    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json",
                                      completion_refused_s=0.05))
    sent: list[dict[str, Any]] = []

    class Answering:
        def __init__(self, refuse_failures: bool) -> None:
            self.refuse_failures = refuse_failures

        async def submit(self, item: dict[str, Any]) -> dict[str, Any]:
            sent.append(item)
            await asyncio.sleep(0.005)
            if item["ok"] or self.refuse_failures:
                return {"ok": False, "status": 500, "error": {"code": "internal_error", "message": "internal error"}}
            return {"ok": True, "action": "retry"}

    try:
        sup._completions = Answering(refuse_failures=False)  # type: ignore[assignment]
        with caplog.at_level("INFO", logger="run_engine.supervisor"):
            answer = await asyncio.wait_for(sup._complete("run_1", {
                "runId": "run_1", "snapshotId": "s", "ok": True, "output": {"x": 1}}), 10)
        assert answer == {"ok": True, "action": "retry"}
        assert len(sent) > 2 and all(i["ok"] for i in sent[:-1])  # held, tried again, then reported failed
        assert sent[-1] == {"runId": "run_1", "snapshotId": "s", "ok": False, "retryable": True, "error": {
            "type": "COMPLETION_REFUSED", "name": "CompletionRefused",
            "message": "the engine could not take the attempt's output (internal_error: internal error)"}}
        assert "reporting the attempt as failed (COMPLETION_REFUSED" in caplog.text
        assert sup.completions_lost == [] and sup.completions_pending == 0

        sent.clear()
        sup._completions = Answering(refuse_failures=True)  # type: ignore[assignment]
        answer = await asyncio.wait_for(sup._complete("run_2", {
            "runId": "run_2", "snapshotId": "s", "ok": False, "error": {"type": "X", "message": "m"}}), 10)
        assert answer["status"] == 500  # given up: its heartbeats stop, its heartbeat timeout retries it
        assert sent[0]["error"]["type"] == "X" and sent[-1]["error"]["type"] == "COMPLETION_REFUSED"
        assert sup.completions_lost == ["run_2"] and sup.completions_pending == 0
    finally:
        await sup.http.close()


async def test_a_completion_answered_500_now_and_then_is_held_as_long_as_it_takes(monkeypatch: Any) -> None:
    """500s broken by any other answer (503: the engine away) do not add up to a refusal."""
    quick_retries(monkeypatch)
    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json",
                                      completion_refused_s=0.05))
    sent: list[dict[str, Any]] = []

    class Answering:
        async def submit(self, item: dict[str, Any]) -> dict[str, Any]:
            sent.append(item)
            await asyncio.sleep(0.02)
            if len(sent) == 40:
                return {"ok": True, "action": "complete"}
            return {"ok": False, "status": 500 if len(sent) % 2 else 503, "error": {}}

    sup._completions = Answering()  # type: ignore[assignment]
    try:
        answer = await asyncio.wait_for(sup._complete("run_1", {"runId": "run_1", "snapshotId": "s", "ok": True}), 10)
        assert answer == {"ok": True, "action": "complete"} and all(i["ok"] for i in sent) and len(sent) == 40
    finally:
        await sup.http.close()


async def test_a_held_completion_is_tried_at_once_when_the_supervisor_stops_and_delivered(monkeypatch: Any) -> None:
    quick_retries(monkeypatch)
    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json", concurrency=1,
                                      completion_retry_s=0))
    sup.pool = Pool()  # type: ignore[assignment]
    completions = sup._completions = Refusing(sup)  # type: ignore[assignment]
    try:
        task = await handed(sup, item("run_1"))
        await until(lambda: len(completions.tries) > 2 or task.done())
        assert not task.done()  # held (before: given up after completion_retry_s, here at once)

        completions.taken = True  # the engine is back as the supervisor is told to stop
        sup.stop()
        await asyncio.wait_for(task, 10)
        assert completions.tries[-1] == ("run_1", True)  # tried after the stop, and taken
        assert sup.completed == 1 and sup.completions_lost == [] and sup.completions_pending == 0
    finally:
        await sup.http.close()


async def test_a_supervisor_stopping_tries_its_held_completions_then_gives_them_up_logged(
        monkeypatch: Any, caplog: Any) -> None:
    """Stopped while the engine cannot take any completion: the run waiting for a turn to report
    (the concurrency's completions already wait) no longer waits for one, every held completion
    is tried after the stop, then given up after completion_retry_s and listed as lost as the
    supervisor exits (their runs are retried at their heartbeat timeout)."""
    quick_retries(monkeypatch)
    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json", concurrency=1,
                                      completion_retry_s=0))
    sup.pool = Pool()  # type: ignore[assignment]
    completions = sup._completions = Refusing(sup)  # type: ignore[assignment]
    dequeues = [[item("run_1")], [item("run_2")]]

    async def connect() -> bool:
        return True

    async def dequeue(max_runs: int) -> list[dict[str, Any]]:
        if dequeues:
            return dequeues.pop(0)
        await sup._stopping.wait()
        return []

    monkeypatch.setattr(sup, "_connect_unless_stopped", connect)
    monkeypatch.setattr(sup, "_dequeue", dequeue)
    monkeypatch.setattr("supervisor.supervisor.heap.settle", lambda: None)
    try:
        with caplog.at_level("INFO", logger="run_engine.supervisor"):
            running = asyncio.create_task(sup._run())
            # run_1's completion is retried; run_2, done too, keeps its slot waiting for a turn to report
            await until(lambda: not dequeues and sup.pool.busy == 0 and len(completions.tries) > 2)
            assert {r for r, _ in completions.tries} == {"run_1"} and sup._slots.locked()
            assert not running.done()
            sup.stop()
            await asyncio.wait_for(running, 10)
        assert ("run_1", True) in completions.tries and ("run_2", True) in completions.tries
        assert sorted(sup.completions_lost) == ["run_1", "run_2"] and sup.completions_pending == 0
        assert "stopped with 2 completions the engine did not take" in caplog.text
        assert "run run_2: the supervisor stops and the engine has not taken its completion" in caplog.text
    finally:
        await sup.http.close()


async def test_a_finished_run_waiting_for_a_turn_to_report_reports_at_once_when_the_supervisor_stops(
        monkeypatch: Any) -> None:
    """The concurrency's completions wait for the engine: a run finished after them keeps its slot
    and waits for a turn, which the supervisor stopping (no more dequeues) gives at once; it does
    not wait for the others' completions to be taken (or given up, completion_retry_s later)."""
    quick_retries(monkeypatch)
    sup = Supervisor(SupervisorConfig(api_url="http://x", token="t", tasks_module="json", concurrency=1,
                                      completion_retry_s=3600))
    sup.pool = Pool()  # type: ignore[assignment]
    completions = sup._completions = Refusing(sup)  # type: ignore[assignment]
    completions.taken_of.add("run_2")
    try:
        first = await handed(sup, item("run_1"))
        await until(lambda: len(completions.tries) > 2)
        second = await handed(sup, item("run_2"))
        await until(lambda: sup.pool.busy == 0)
        assert {r for r, _ in completions.tries} == {"run_1"} and sup._slots.locked()  # waits for a turn
        sup.stop()
        await until(second.done)  # taken while run_1's completion is still held
        await second
        assert ("run_2", True) in completions.tries and not first.done()
        assert not sup._slots.locked()
        completions.taken_of.add("run_1")
        await asyncio.wait_for(first, 10)
        assert sup.completed == 2 and sup.completions_lost == [] and sup._reporting._value == 1
    finally:
        await sup.http.close()
