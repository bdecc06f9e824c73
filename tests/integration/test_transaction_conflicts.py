"""A transaction PostgreSQL rolls back for what ran beside it (a deadlock, 40P01; a serialization
failure, 40001) is no error of the request's: a metadata change (one transaction locking the run,
its parent and its root) is run again, from the operations as sent, a few times; past them the
API answers 503 with Retry-After (what the SDK and the supervisor retry), never a 500."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import psycopg
import pytest

from run_engine.db.runs import RunRepository
from run_engine.dependencies import CONFLICT_ATTEMPTS
from run_engine.engine import TriggerRequest

from .conftest import Harness, api_client
from .test_metadata_operations import family, metadata, path, token


async def test_a_real_deadlock_with_a_metadata_change_is_run_again(h: Harness, database_url: str) -> None:
    _, child, grandchild = await family(h)
    first, second = sorted((child.id, grandchild.id))  # the order the change locks them in
    body = {"operations": [{"type": "increment", "key": "mine", "value": 1}],
            "parentOperations": [{"type": "increment", "key": "children", "value": 1}]}
    async with await psycopg.AsyncConnection.connect(database_url) as other, \
            api_client(h, token(h, grandchild)) as api:
        # another transaction takes the two rows in the other order: the second first...
        await other.execute("SELECT 1 FROM task_run WHERE id = %s FOR UPDATE", (second,))
        mine = (await (await other.execute("SELECT pg_backend_pid()")).fetchone() or [0])[0]
        request = asyncio.create_task(api.put(path(grandchild.id), json=body))
        deadline = time.monotonic() + 30
        while True:  # ...until the change holds the first and waits for the second...
            cur = await other.execute("SELECT count(*) FROM pg_stat_activity "
                                      "WHERE %s = ANY(pg_blocking_pids(pid))", (mine,))
            if (await cur.fetchone() or [0])[0]:
                break
            assert time.monotonic() < deadline and not request.done(), "the change never waited for the row"
            await asyncio.sleep(0.01)
        # ...then the first: a deadlock, which PostgreSQL breaks by rolling the change back (it
        # waited first, so its deadlock_timeout ran out first)
        await other.execute("SELECT 1 FROM task_run WHERE id = %s FOR UPDATE", (first,))
        await other.commit()
        answer = await request
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"metadata": {"mine": 1}}
    assert await metadata(h, child.id) == {"children": 1}  # applied once
    assert await metadata(h, grandchild.id) == {"mine": 1}


def conflicting(monkeypatch: pytest.MonkeyPatch, fails: int, exc: Callable[[], Exception]) -> list[int]:
    """RunRepository.change_metadata rolled back ``fails`` times by ``exc`` after its changes were
    computed (operations applied), then as it is; → the number of tries, as they are made."""
    real = RunRepository.change_metadata
    tries: list[int] = []

    async def change_metadata(self: RunRepository, env_id: str, run_ids: Any, change: Any, **kw: Any) -> Any:
        tries.append(len(tries) + 1)

        def then_fail(run_id: str, md: Any) -> Any:
            new = change(run_id, md)
            if len(tries) <= fails:
                raise exc()
            return new

        return await real(self, env_id, run_ids, then_fail, **kw)

    monkeypatch.setattr(RunRepository, "change_metadata", change_metadata)
    return tries


@pytest.mark.parametrize("exc", [lambda: psycopg.errors.DeadlockDetected("deadlock detected"),
                                 lambda: psycopg.errors.SerializationFailure("could not serialize access")])
async def test_a_conflict_is_run_again_from_the_operations_as_sent(
        h: Harness, api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, exc: Callable[[], Exception]) -> None:
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    tries = conflicting(monkeypatch, 1, exc)
    # the values the first try put into the metadata and changed there are not those of the second
    ops = [{"type": "update", "value": {"n": 0, "items": []}}, {"type": "increment", "key": "$.n", "value": 1},
           {"type": "append", "key": "$.items", "value": "x"}]
    answer = await api.put(path(run.id), json={"operations": ops})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"metadata": {"n": 1, "items": ["x"]}}
    assert await metadata(h, run.id) == {"n": 1, "items": ["x"]}
    assert tries == [1, 2]


async def test_past_its_tries_a_conflict_is_a_503_to_retry(
        h: Harness, api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", metadata={"a": 1}))
    tries = conflicting(monkeypatch, CONFLICT_ATTEMPTS, lambda: psycopg.errors.DeadlockDetected("deadlock detected"))
    answer = await api.put(path(run.id), json={"operations": [{"type": "set", "key": "b", "value": 2}]})
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"] and answer.json()["error"] == {
        "code": "service_unavailable", "dependency": "postgres",  # (as documented)
        "message": "PostgreSQL rolled the transaction back (deadlock detected); try again"}  # not "unavailable"
    assert len(tries) == CONFLICT_ATTEMPTS
    assert await metadata(h, run.id) == {"a": 1}  # nothing written
