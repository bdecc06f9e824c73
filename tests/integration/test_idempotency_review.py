"""From a review of idempotency keys and waitpoint tokens (tenants, crashes, expiry, bad input):
each test shows a bug of the code before it."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from .conftest import Harness


async def batch_runs(api: httpx.AsyncClient, batch_id: str) -> list[str]:
    got = await api.get(f"/api/v2/batches/{batch_id}")
    assert got.status_code == 200, got.text
    runs: list[str] = got.json()["runs"]
    return runs


async def test_a_retried_stream_makes_no_second_run_of_an_item_whose_own_key_expired(
        h: Harness, api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A two-phase batch's stream retried after its first attempt made the runs and died before
    noting its items (the SDK sends it again): each index is deduplicated by its key. An item with
    a key of its own whose TTL had passed by then had that key released by the retry itself, and a
    second run of the item was made in the batch (a batch of 2 with 3 runs; the item ran twice)."""
    opened = await api.post("/api/v3/batches", json={"runCount": 2})
    batch_id = opened.json()["id"]
    lines = b"\n".join(orjson.dumps(item) for item in [
        {"index": 0, "task": "hello", "options": {"idempotencyKey": "own", "idempotencyKeyTTL": "1s"}},
        {"index": 1, "task": "hello"}])
    noted = h.engine.note_batch_items
    calls = 0

    async def dies_the_first_time(*args: Any, **kwargs: Any) -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("the process died before noting the items")
        return await noted(*args, **kwargs)

    monkeypatch.setattr(h.engine, "note_batch_items", dies_the_first_time)
    with pytest.raises(ConnectionError):
        await api.post(f"/api/v3/batches/{batch_id}/items", content=lines)
    made = await batch_runs(api, batch_id)
    assert len(made) == 2
    h.clock.advance(2)  # the item's own key has expired when the stream is sent again
    again = await api.post(f"/api/v3/batches/{batch_id}/items", content=lines)
    assert again.status_code == 200, again.text
    assert again.json()["sealed"] and again.json()["itemsDeduplicated"] == 2, again.json()
    assert sorted(await batch_runs(api, batch_id)) == sorted(made)  # before: a third run, item 0's again
    # outside the batch the key's TTL holds as ever: a trigger with it makes a new run
    other = await api.post("/api/v1/tasks/hello/trigger", json={"options": {"idempotencyKey": "own"}})
    assert other.status_code == 200 and other.json()["isCached"] is False and other.json()["id"] not in made


@pytest.mark.parametrize(("path", "body"), [
    ("/api/v1/tasks/hello/trigger", {"options": {"idempotencyKey": ""}}),
    ("/api/v2/tasks/batch", {"items": [{"task": "hello", "options": {"idempotencyKey": ""}}]}),
])
async def test_an_empty_idempotency_key_is_refused(h: Harness, api: httpx.AsyncClient, path: str,
                                                   body: dict[str, Any]) -> None:
    """``idempotencyKey: ""`` was a key like any other: every trigger with it answered with the
    first run for 30 days, and ``POST /api/v1/idempotencyKeys/{key}/reset``, which takes 1 to 256
    characters, could not free it. A token's empty key was refused (400) already."""
    first = await api.post(path, json=body)
    assert first.status_code == 400, first.text
    assert first.json()["error"]["code"] == "invalid_input" and "idempotencyKey" in first.json()["error"]["message"]
    assert await h.engine.list_runs(h.env.env_id, limit=10, light=True) == []


@pytest.mark.parametrize("options", [{"idempotencyKey": "k", "idempotencyKeyTTL": True}, {"ttl": True},
                                     {"delay": False}])
async def test_true_or_false_is_no_duration_of_a_trigger(h: Harness, api: httpx.AsyncClient,
                                                         options: dict[str, Any]) -> None:
    """pydantic took ``true`` for a number: ``idempotencyKeyTTL: true`` kept the key one second
    (a retry a second later made a second run), ``ttl: true`` was one second; a token's timeout and
    key TTL refused booleans already."""
    refused = await api.post("/api/v1/tasks/hello/trigger", json={"options": options})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "invalid_input"
    opened = await api.post("/api/v3/batches", json={"runCount": 1, "idempotencyKey": "b", "idempotencyKeyTTL": True})
    assert opened.status_code == 400, opened.text


async def test_the_engine_refuses_an_empty_idempotency_key(h: Harness) -> None:
    """The same at the engine (the SDK's and the engine's own callers): no run is made with it."""
    from run_engine.engine import TriggerRequest
    from run_engine.errors import ValidationError

    with pytest.raises(ValidationError, match="idempotency_key"):
        await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", idempotency_key=""))
    assert await h.engine.list_runs(h.env.env_id, limit=10, light=True) == []


class _HookedPool:
    """A pool whose connections run ``hook`` once, right after the first statement naming ``marker``:
    another request's write between two statements of one call, at that exact point."""

    def __init__(self, pool: Any, marker: str, hook: Any) -> None:
        self.pool, self.marker, self.hook, self.fired = pool, marker, hook, False

    def connection(self) -> Any:
        import contextlib

        hooked = self

        class Executes:  # a connection or a cursor
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def __getattr__(self, name: str) -> Any:
                return getattr(self.inner, name)

            def cursor(self, *args: Any, **kwargs: Any) -> Any:
                return Executes(self.inner.cursor(*args, **kwargs))

            async def execute(self, sql: str, *args: Any, **kwargs: Any) -> Any:
                done = await self.inner.execute(sql, *args, **kwargs)
                if hooked.marker in sql and not hooked.fired:
                    hooked.fired = True
                    await hooked.hook()
                return self if done is self.inner else done

        @contextlib.asynccontextmanager
        async def connect() -> Any:
            async with self.pool.connection() as conn:
                yield Executes(conn)

        return connect()


async def test_a_batch_key_let_go_between_the_insert_and_the_look_up_opens_a_batch_not_a_500(
        h: Harness, api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests with one batch key at once: the first, refused for a bad item, frees the key it
    took (``release_empty_batch_key``) just after the second's insert found it taken and before the
    second read the batch holding it. The second asserted that the batch was there: an
    AssertionError, a 500 for a request that was fine (its retry would have worked)."""
    repo = h.engine.resources.repo.waitpoints
    first, _, _ = await h.engine.open_batch(h.env.env_id, 1, "shared", two_phase=False)  # the first request's row

    async def first_request_fails() -> None:  # its item refused: its key freed (it made no run)
        assert await h.engine.release_empty_batch_key(h.env.env_id, first)

    monkeypatch.setattr(repo, "pool", _HookedPool(repo.pool, "INSERT INTO batch_task_run", first_request_fails))
    second = await api.post("/api/v2/tasks/batch", json={"items": [{"task": "hello"}]},
                            headers={"idempotency-key": "shared"})
    assert second.status_code == 200, second.text  # before: 500
    assert second.json()["id"] != first and second.json()["isCached"] is False
    assert len(await batch_runs(api, second.json()["id"])) == 1


async def test_a_key_let_go_between_the_insert_and_the_look_up_of_its_holder_makes_the_run_not_a_400(
        h: Harness, api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trigger whose insert found its key taken, the key let go before it looked the holder up (an
    operator's reset right then; or, with ``idempotencyKeyTTL: 0``, another trigger releasing a
    holder whose TTL had passed at once, which concurrent triggers hit within a few tries): it was
    answered 400 ``invalid_input`` "the key changed hands concurrently; retry", a refusal of its
    input that a client does not retry. The key is free: the trigger takes it."""
    held = await api.post("/api/v1/tasks/hello/trigger", json={"options": {"idempotencyKey": "k"}})
    runs = h.engine.resources.repo.runs
    look_up = runs.runs_by_idempotency_key
    reset = False

    async def reset_first(*args: Any, **kwargs: Any) -> Any:
        nonlocal reset
        if not reset:  # the reset lands between this trigger's insert and its look-up
            reset = True
            assert await h.engine.reset_idempotency_key(h.env.env_id, "hello", "k")
        return await look_up(*args, **kwargs)

    monkeypatch.setattr(runs, "runs_by_idempotency_key", reset_first)
    again = await api.post("/api/v1/tasks/hello/trigger", json={"options": {"idempotencyKey": "k"}})
    assert reset and again.status_code == 200, again.text  # before: 400
    assert again.json()["isCached"] is False and again.json()["id"] != held.json()["id"]
    monkeypatch.undo()
    third = await api.post("/api/v1/tasks/hello/trigger", json={"options": {"idempotencyKey": "k"}})
    assert third.json() == {"id": again.json()["id"], "isCached": True}  # the new run holds the key
    handed = await h.engine.dequeue(h.env.worker_group_id, 5)
    assert {d.run.id for d in handed} == {held.json()["id"], again.json()["id"]}  # the new run was enqueued too


async def test_a_run_waitpoint_key_let_go_between_the_insert_and_the_look_up_makes_one_not_a_500(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same race for a waitpoint's key: a wait on a run (``wait.for_run``) finds the run's
    ``run:<id>`` key taken by its completed RUN waitpoint, and, before it reads that waitpoint, a
    concurrent wait on the run (redriven from the DLQ since) lets the completed one's key go. The
    look-up found nothing and asserted it had: an AssertionError, a 500 for the wait."""
    from run_engine.engine import TriggerRequest

    target = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    (handed,) = await h.engine.dequeue(h.env.worker_group_id, 1)
    started = await h.engine.start_attempt(target.id, handed.snapshot.id)
    await h.engine.complete_attempt(target.id, started.snapshot.id, ok=True, output=1)
    done = await h.engine.get_waitpoint((await h.engine.run_waitpoint(h.env.env_id, target.id)).id)
    assert done is not None and done.status == "COMPLETED"  # the run had finished: completed at once
    repo = h.engine.resources.repo.waitpoints

    async def another_wait_lets_it_go() -> None:
        await repo.release_run_key(done.id, f"run:{target.id}")

    monkeypatch.setattr(repo, "pool", _HookedPool(repo.pool, "INSERT INTO waitpoint", another_wait_lets_it_go))
    made = await h.engine.run_waitpoint(h.env.env_id, target.id)  # before: AssertionError
    again = await h.engine.get_waitpoint(made.id)
    assert again is not None and again.id != done.id and again.completed_by_run_id == target.id
    assert again.status == "COMPLETED" and again.output == 1  # the run has finished: answered at once


async def test_a_public_token_cannot_take_the_key_of_a_schedules_next_tick(h: Harness, database_url: str) -> None:
    """A scheduled run's ``idempotencyKey`` (``schedule:<schedule>:<tick>``, shown to whoever may
    read the run) names the next ticks too. A public access token that may trigger the task (one
    handed to a browser) triggered it with the next tick's key: the schedule's run of that tick then
    joined the token's run, with the token holder's payload, and the scheduled run was never made.
    Keys of the shapes the engine gives its own runs (a schedule's tick, a batch's item, a bulk
    replay's) are the environment's secret key's to name."""
    from datetime import UTC, datetime

    import psycopg

    from run_engine.api.public_tokens import AUDIENCE, ISSUER, sign
    from systems.schedules import schedule_key

    from .conftest import api_client

    sched = await h.engine.systems.schedules.upsert(h.env.env_id, task="hello", cron="* * * * *")
    try:
        now = int(h.clock.now())
        token = sign(h.env.api_key, {"sub": h.env.env_id, "pub": True, "iss": ISSUER, "aud": AUDIENCE, "iat": now,
                                     "exp": now + 600, "scopes": ["trigger:tasks:hello", "batchTrigger:tasks:hello"]})
        tick = sched.next_run_at
        async with api_client(h, token) as browser:
            taken = await browser.post("/api/v1/tasks/hello/trigger", json={
                "payload": {"scheduleId": sched.id, "forged": True},
                "options": {"idempotencyKey": schedule_key(sched.id, tick)}})
            assert taken.status_code == 403, taken.text  # before: 200
            assert taken.json()["error"]["code"] == "forbidden"
            for key in (f"{h.engine.new_batch_id()}:0", "bulk_abc:run_def"):
                batched = await browser.post("/api/v1/tasks/batch", json={
                    "items": [{"task": "hello", "options": {"idempotencyKey": key}}]})
                assert batched.status_code == 403, batched.text
            mine = await browser.post("/api/v1/tasks/hello/trigger", json={"options": {"idempotencyKey": "schedule"}})
            assert mine.status_code == 200, mine.text  # a key of its own, of any other shape
        h.clock.advance((tick - datetime.fromtimestamp(h.clock.now(), UTC)).total_seconds())
        await h.engine.systems.schedules.fire_due(jitter_s=0)
        (run,) = await h.engine.list_runs(h.env.env_id, tags=[f"schedule:{sched.id}"], limit=10)
        assert "forged" not in run.payload and run.idempotency_key == schedule_key(sched.id, tick)
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:  # (the planners of other tests)
            conn.execute("DELETE FROM task_schedule WHERE id = %s", (sched.id,))


# --- guarantees that held: what the review tried and could not break --------------------------------

async def test_a_token_completed_as_its_timeout_fires_in_another_process_has_one_outcome(
        h: Harness, make_engine: Any) -> None:
    """An outside system completes tokens in one server process while another's job worker fires
    their timeouts at the same moment: each token ends with one outcome (the completion's output or
    the timeout's error), only the winner hears True, and its waiting run is resumed once, with it."""
    import asyncio

    from run_engine.engine import TriggerRequest

    other: Harness = await make_engine()  # another process of the same installation
    assert other.env.env_id == h.env.env_id
    runs = [await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello")) for _ in range(8)]
    handed = {d.run.id: d for d in await h.engine.dequeue(h.env.worker_group_id, 8)}
    tokens = []
    for run in runs:
        started = await h.engine.start_attempt(run.id, handed[run.id].snapshot.id)
        token, _ = await h.engine.create_token(h.env.env_id, timeout_s=5)
        await h.engine.block(run.id, started.snapshot.id, sequence=0, kind="token", key=token.id,
                             waitpoint_ids=[token.id])
        tokens.append(token)
    h.clock.advance(6)
    other.clock.advance(6)

    async def complete(token_id: str, after: int) -> bool:  # each a little later than the one before
        for _ in range(after):
            await asyncio.sleep(0.001)
        return await h.engine.complete_waitpoint(token_id, {"by": "outside"}, env_id=h.env.env_id)

    _, *won = await asyncio.gather(other.engine.run_due_jobs(), *[complete(t.id, i) for i, t in enumerate(tokens)])
    for run, token, completed in zip(runs, tokens, won, strict=True):
        wp = await h.engine.get_waitpoint(token.id)
        assert wp is not None and wp.status == "COMPLETED"
        assert wp.output_is_error is not completed  # the completion won iff it heard True
        (entry,) = (await h.engine.waitpoints.resolved_journal(run.id)).entries
        assert entry["result"] == ({"ok": True, "output": {"by": "outside"}} if completed
                                   else {"ok": False, "error": wp.output})
        statuses = await h.statuses(run.id)
        assert statuses[-2:] == ["EXECUTING_WITH_WAITPOINTS", "EXECUTING"], statuses  # resumed once
        assert not await other.engine.complete_waitpoint(token.id, "late", env_id=h.env.env_id)  # the first stays


async def test_triggers_racing_on_an_expired_key_in_two_processes_make_one_run(
        h: Harness, make_engine: Any) -> None:
    """The run holding a key whose TTL passed gives it up to the first trigger; many triggers with
    it at once, in two processes, make one new run and are all answered with it."""
    import asyncio

    from run_engine.engine import TriggerRequest

    other: Harness = await make_engine()

    def keyed() -> TriggerRequest:
        return TriggerRequest(env_id=h.env.env_id, task_id="hello", idempotency_key="k", idempotency_key_ttl_s=1)

    old = await h.engine.trigger(keyed())
    h.clock.advance(2)
    other.clock.advance(2)
    answers = await asyncio.gather(*[(h if i % 2 else other).engine.trigger(keyed()) for i in range(12)])
    assert len({a.id for a in answers}) == 1 and answers[0].id != old.id
    assert sum(not a.is_cached for a in answers) == 1


async def test_triggers_racing_on_a_key_kept_no_time_in_two_processes_are_all_answered(
        h: Harness, make_engine: Any) -> None:
    """``idempotencyKeyTTL: 0``: every holder's key has expired as soon as it is made, so each
    trigger may release the one before's between another's insert and its look-up (the race of
    the test above, unforced): every trigger is answered with a run (before: a few of 200 were 400)."""
    import asyncio

    from run_engine.engine import TriggerRequest

    other: Harness = await make_engine()
    for _ in range(20):
        answers = await asyncio.gather(*[(h if i % 2 else other).engine.trigger(TriggerRequest(
            env_id=h.env.env_id, task_id="hello", idempotency_key="k", idempotency_key_ttl_s=0)) for i in range(10)],
            return_exceptions=True)
        assert not [a for a in answers if isinstance(a, Exception)]
