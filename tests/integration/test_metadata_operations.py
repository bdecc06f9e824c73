"""`PUT /api/v1/runs/{runId}/metadata` with Trigger.dev's operations (`metadata.set/del/append/
remove/increment/update`, and `metadata.parent.*`, `metadata.root.*`): each applied to the metadata
as it is under the run's row lock, all of a request in one transaction; a bad operation, or a result
past the metadata limit, changes nothing."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from run_engine.engine import RunRow, TriggerRequest
from run_engine.run_tokens import RunTokens
from run_engine.tenancy import ensure_environment

from .conftest import Harness, api_client
from .test_realtime_review import count_full_reads, events, until
from .test_stream_credentials import streaming


def path(run_id: str) -> str:
    return f"/api/v1/runs/{run_id}/metadata"


async def metadata(h: Harness, run_id: str) -> Any:
    run = await h.engine.get_run(run_id)
    assert run is not None
    return run.metadata


async def family(h: Harness) -> tuple[RunRow, RunRow, RunRow]:
    """A root run, its child and its grandchild, all executing (attempt 1)."""
    env = h.env.env_id
    root = await h.engine.trigger(TriggerRequest(env_id=env, task_id="hello", metadata={"seed": "root"}))
    child = await h.engine.trigger(TriggerRequest(env_id=env, task_id="hello", parent_run_id=root.id,
                                                  root_run_id=root.id, depth=1))
    grandchild = await h.engine.trigger(TriggerRequest(env_id=env, task_id="hello", parent_run_id=child.id,
                                                       root_run_id=root.id, depth=2))
    handed = await h.engine.dequeue(h.env.worker_group_id, 10, start=True)
    assert {d.run.id for d in handed} == {root.id, child.id, grandchild.id}
    rows = [await h.engine.get_run(r.id) for r in (root, child, grandchild)]
    assert all(r is not None for r in rows)
    return rows[0], rows[1], rows[2]  # type: ignore[return-value]


def token(h: Harness, run: RunRow) -> str:
    return RunTokens("test-secret").mint(run.id, 1, int(h.clock.now()) + 3600)


async def test_each_operation_type(h: Harness, api: httpx.AsyncClient) -> None:
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello",
                                                metadata={"gone": 1, "log": "first", "tags": ["a", 1, True, {"x": 1}],
                                                          "progress": {"done": 1, "items": [0, 0]}}))
    ops = [{"type": "set", "key": "status", "value": "running"},
           {"type": "delete", "key": "gone"},
           {"type": "delete", "key": "never-there"},
           {"type": "append", "key": "log", "value": "second"},   # a value that is no list becomes one
           {"type": "append", "key": "new", "value": {"n": 1}},   # a missing key: [value]
           {"type": "remove", "key": "tags", "value": 1},         # true is not 1
           {"type": "remove", "key": "tags", "value": {"x": 1}},
           {"type": "remove", "key": "status", "value": "running"},  # no list: nothing
           {"type": "increment", "key": "count", "value": 2},     # a missing key counts as 0
           {"type": "increment", "key": "count", "value": -0.5},  # decrement
           {"type": "increment", "key": "status2", "value": 1},
           {"type": "set", "key": "$.progress.done", "value": 2},
           {"type": "increment", "key": "$.progress.items.1", "value": 5},
           {"type": "append", "key": "$.progress.items", "value": 9},
           {"type": "set", "key": "$.progress.items.3", "value": 7},  # one past the end appends
           {"type": "set", "key": "$.missing.deep", "value": 1},      # a path through nothing: nothing
           {"type": "set", "key": "__proto__", "value": {"polluted": True}}]  # a key like any other
    answer = await api.put(path(run.id), json={"operations": ops})
    assert answer.status_code == 200, answer.text
    expected = {"log": ["first", "second"], "new": [{"n": 1}], "tags": ["a", True], "status": "running",
                "count": 1.5, "status2": 1, "progress": {"done": 2, "items": [0, 5, 9, 7]},
                "__proto__": {"polluted": True}}
    assert answer.json() == {"metadata": expected}
    assert await metadata(h, run.id) == expected
    answer = await api.put(path(run.id), json={"operations": [{"type": "update", "value": {"fresh": True}}]})
    assert answer.json() == {"metadata": {"fresh": True}} and await metadata(h, run.id) == {"fresh": True}
    assert "run_updated" in h.names(run.id)


async def test_operations_win_over_metadata_and_keep_the_seed(h: Harness, api: httpx.AsyncClient) -> None:
    """As Trigger.dev: a body with `operations` (even empty) ignores its `metadata`; the first
    change keeps the trigger's metadata as the run's seed (what a replay starts with)."""
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", metadata={"step": "start"}))
    answer = await api.put(path(run.id), json={"metadata": {"ignored": True}, "operations": []})
    assert answer.json() == {"metadata": {"step": "start"}}
    answer = await api.put(path(run.id), json={"metadata": {"ignored": True},
                                               "operations": [{"type": "set", "key": "step", "value": "half"}]})
    assert answer.json() == {"metadata": {"step": "half"}}
    answer = await api.put(path(run.id), json={"operations": [{"type": "set", "key": "step", "value": "done"}]})
    assert answer.json() == {"metadata": {"step": "done"}}
    replay = await api.post(f"/api/v1/runs/{run.id}/replay")
    assert replay.status_code == 200, replay.text
    assert await metadata(h, replay.json()["id"]) == {"step": "start"}


async def test_a_child_changes_its_parent_and_its_root_with_its_run_token(h: Harness) -> None:
    root, child, grandchild = await family(h)
    body = {"operations": [{"type": "set", "key": "me", "value": "grandchild"}],
            "parentOperations": [{"type": "increment", "key": "children", "value": 1}],
            "rootOperations": [{"type": "append", "key": "seen", "value": grandchild.id},
                               {"type": "increment", "key": "total", "value": 1}]}
    async with api_client(h, token(h, grandchild)) as api:
        answer = await api.put(path(grandchild.id), json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"metadata": {"me": "grandchild"}}
    assert await metadata(h, child.id) == {"children": 1}
    assert await metadata(h, root.id) == {"seed": "root", "seen": [grandchild.id], "total": 1}
    for run in (root, child, grandchild):
        assert "run_updated" in h.names(run.id)  # what wakes their realtime streams
    # the child's own token: its parent is the root (parent and root operations both act on it)
    async with api_client(h, token(h, child)) as api:
        answer = await api.put(path(child.id), json={"parentOperations": [{"type": "increment", "key": "total",
                                                                           "value": 10}],
                                                     "rootOperations": [{"type": "increment", "key": "total",
                                                                         "value": 100}]})
    assert answer.json() == {"metadata": {"children": 1}}  # its own, unchanged
    assert (await metadata(h, root.id))["total"] == 111
    # a root run is its own parent and root (Trigger.dev's SDK sends metadata.parent.* of a root so)
    async with api_client(h, token(h, root)) as api:
        answer = await api.put(path(root.id), json={"operations": [{"type": "increment", "key": "total", "value": 1}],
                                                    "parentOperations": [{"type": "increment", "key": "total",
                                                                          "value": 1}],
                                                    "rootOperations": [{"type": "increment", "key": "total",
                                                                        "value": 1}]})
    assert answer.json()["metadata"]["total"] == 114


async def test_a_parent_that_is_gone_is_left_out(h: Harness, api: httpx.AsyncClient) -> None:
    root, child, _ = await family(h)
    async with h.engine.resources.repo.pool.connection() as conn:  # retention took the root
        await conn.execute("DELETE FROM task_run WHERE id = %s", (root.id,))
    answer = await api.put(path(child.id), json={"operations": [{"type": "set", "key": "a", "value": 1}],
                                                 "parentOperations": [{"type": "set", "key": "b", "value": 1}]})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"metadata": {"a": 1}}


async def test_concurrent_increments_of_a_root_lose_nothing(h: Harness) -> None:
    """Two children (and an API key on the root itself) increment the root's counter at once, many
    times: every increment counts (a read-modify-write without the row lock loses some)."""
    root, child, grandchild = await family(h)
    rounds = 25

    async def bump(credential: str | None, run_id: str, field: str) -> None:
        async with api_client(h, credential) as api:
            for _ in range(rounds):
                answer = await api.put(path(run_id), json={field: [{"type": "increment", "key": "n", "value": 1}]})
                assert answer.status_code == 200, answer.text

    await asyncio.gather(bump(token(h, child), child.id, "rootOperations"),
                         bump(token(h, grandchild), grandchild.id, "rootOperations"),
                         bump(token(h, grandchild), grandchild.id, "parentOperations"),
                         bump(None, root.id, "operations"))
    assert (await metadata(h, root.id))["n"] == 3 * rounds
    assert (await metadata(h, child.id))["n"] == rounds


@pytest.mark.parametrize(("op", "field"), [
    ({"type": "rename", "key": "a"}, "operations.1.type"),
    ({"key": "a", "value": 1}, "operations.1.type"),
    ({"type": "set", "value": 1}, "operations.1.key"),
    ({"type": "set", "key": 5, "value": 1}, "operations.1.key"),
    ({"type": "set", "key": "a"}, "operations.1.value"),
    ({"type": "increment", "key": "a", "value": "1"}, "operations.1.value"),
    ({"type": "increment", "key": "a", "value": True}, "operations.1.value"),
    ({"type": "update", "value": [1]}, "operations.1.value"),
    ({"type": "set", "key": "$..a", "value": 1}, "operations.1.key"),
    ({"type": "set", "key": "$.a.*", "value": 1}, "operations.1.key"),
    ({"type": "set", "key": "$.", "value": 1}, "operations.1.key"),
    ({"type": "set", "key": "$." + ".".join(["a"] * 101), "value": 1}, "operations.1.key"),
    ({"type": "set", "key": "k" * 2000, "value": 1}, "operations.1.key"),
    ({"type": "set", "key": "$.list.5", "value": 1}, "operations.1.key"),       # past the list's end
    ({"type": "increment", "key": "big", "value": 1.7e308}, "operations.1.value"),  # not finite
    ("set", "operations.1"),
])
async def test_a_bad_operation_is_400_naming_it_and_changes_nothing(
        h: Harness, api: httpx.AsyncClient, op: Any, field: str) -> None:
    root, child, _ = await family(h)
    await h.engine.set_metadata(h.env.env_id, child.id, {"list": [1], "big": 1.7e308})
    before = {r.id: await metadata(h, r.id) for r in (root, child)}
    answer = await api.put(path(child.id), json={"operations": [{"type": "set", "key": "a", "value": 1}, op],
                                                 "rootOperations": [{"type": "set", "key": "b", "value": 1}]})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_input" and error["message"].startswith(f"{field}: "), error
    assert {r.id: await metadata(h, r.id) for r in (root, child)} == before


async def test_bounds_of_a_request(h: Harness, api: httpx.AsyncClient) -> None:
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", metadata={"keep": 1}))
    many = [{"type": "increment", "key": "n", "value": 1}] * 600
    answer = await api.put(path(run.id), json={"operations": many, "parentOperations": many})
    assert answer.status_code == 400 and answer.json()["error"]["message"].startswith("operations: at most 1000")
    answer = await api.put(path(run.id), json={})
    assert answer.status_code == 400 and answer.json()["error"]["message"].startswith("metadata: ")
    answer = await api.put(path(run.id), json={"operations": "set"})
    assert answer.status_code == 400 and answer.json()["error"]["message"].startswith("operations: ")
    # nested deeper than stored values may be, one level at a time
    deep: list[dict[str, Any]] = [{"type": "set", "key": "d", "value": {}}]
    deep += [{"type": "set", "key": "$." + ".".join(["d"] * i), "value": {}} for i in range(1, 100)]
    deep += [{"type": "append", "key": "$." + ".".join(["d"] * 100), "value": []}]
    answer = await api.put(path(run.id), json={"operations": deep})
    assert answer.status_code == 400, answer.text
    assert "nested more than 100 levels" in answer.json()["error"]["message"]
    # removes that compare too many list items
    await h.engine.set_metadata(h.env.env_id, run.id, {"keep": 1, "l": list(range(5000))})
    removes = [{"type": "remove", "key": "l", "value": -1}] * 201
    answer = await api.put(path(run.id), json={"operations": removes})
    assert answer.status_code == 400 and answer.json()["error"]["message"].startswith("operations.200: "), answer.text
    assert (await metadata(h, run.id))["l"] == list(range(5000))
    # a huge integer sum stays a JSON number (a float past 64 bits)
    answer = await api.put(path(run.id), json={"operations": [{"type": "set", "key": "i", "value": 2**63 - 1},
                                                              {"type": "increment", "key": "i", "value": 2**63 - 1}]})
    assert answer.status_code == 200 and answer.json()["metadata"]["i"] == float(2**64 - 2)


async def test_a_result_past_the_metadata_limit_is_413_and_changes_nothing(make_engine: Any) -> None:
    h: Harness = await make_engine(max_metadata_bytes=512)
    await h.deploy({"id": "hello"})
    root, child, _ = await family(h)
    async with api_client(h, token(h, child)) as api:
        fits = await api.put(path(child.id), json={"operations": [{"type": "set", "key": "a", "value": "x" * 400}]})
        assert fits.status_code == 200, fits.text
        grown = await api.put(path(child.id), json={
            "operations": [{"type": "set", "key": "b", "value": "y" * 10}],
            "parentOperations": [{"type": "append", "key": "log", "value": "z" * 600}]})
        assert grown.status_code == 413, grown.text
        error = grown.json()["error"]
        assert error["code"] == "payload_too_large" and error["message"].startswith("parentOperations: ")
        # the child's own operations, within the limit, were rolled back with the root's
        assert await metadata(h, child.id) == {"a": "x" * 400}
        assert await metadata(h, root.id) == {"seed": "root"}
        whole = await api.put(path(child.id), json={"metadata": {"a": "x" * 600}})
        assert whole.status_code == 413 and whole.json()["error"]["message"].startswith("metadata: ")
        mixed = await api.put(path(child.id), json={"metadata": {"a": "x" * 600},
                                                    "parentOperations": [{"type": "set", "key": "p", "value": 1}]})
        assert mixed.status_code == 413 and await metadata(h, root.id) == {"seed": "root"}


async def test_who_may_change_what(h: Harness) -> None:
    root, child, grandchild = await family(h)
    async with api_client(h, token(h, grandchild)) as api:  # a run token of another run: 403, as before
        for other in (root, child):
            answer = await api.put(path(other.id), json={"operations": [{"type": "set", "key": "x", "value": 1}]})
            assert answer.status_code == 403, answer.text
    async with api_client(h) as api:  # the environment's API key: any of its runs, and their parents
        answer = await api.put(path(child.id), json={"operations": [{"type": "set", "key": "k", "value": 1}],
                                                     "parentOperations": [{"type": "set", "key": "k", "value": 2}]})
        assert answer.status_code == 200 and answer.json() == {"metadata": {"k": 1}}
    assert (await metadata(h, root.id))["k"] == 2
    other = await ensure_environment(h.engine.resources.repo, secret="test-secret", org=f"other-{h.env.env_id}",
                                     project="proj", env="dev")
    async with api_client(h, other.api_key) as api:  # another tenant: the run is not found
        answer = await api.put(path(child.id), json={"operations": [{"type": "set", "key": "x", "value": 1}],
                                                     "rootOperations": [{"type": "set", "key": "x", "value": 1}]})
        assert answer.status_code == 404, answer.text
    assert "x" not in await metadata(h, child.id) and "x" not in await metadata(h, root.id)


async def test_a_parents_stream_sends_the_change_a_child_made(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """A parent's metadata changed by its child's parentOperations reaches the parent's stream, as
    a replacement of its own metadata does."""
    async with streaming(h, monkeypatch) as (run_id, answer):
        full_reads = count_full_reads(h, monkeypatch)
        assert await until(lambda: run_id in full_reads)  # the stream's first event
        child = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", parent_run_id=run_id,
                                                      root_run_id=run_id, depth=1))
        async with api_client(h) as api:
            reads = full_reads.count(run_id)
            changed = await api.put(path(child.id), json={
                "parentOperations": [{"type": "set", "key": "progress", "value": 50}]})
            assert changed.status_code == 200, changed.text
        assert await until(lambda: full_reads.count(run_id) > reads)  # the change's event
        await h.engine.cancel(run_id)
        got = await asyncio.wait_for(answer, 20)
    sent = events(got.text)
    assert [e["metadata"] for e in sent] == [{}, {"progress": 50}, {"progress": 50}]


async def test_a_triggers_metadata_is_bounded_by_the_metadata_limit(make_engine: Any) -> None:
    """A run's metadata is bounded by ``max_metadata_bytes`` from its trigger on, not only by its
    later changes: a trigger's ``options.metadata`` was bounded by the payload limit (3 MiB, twelve
    times the metadata's), and a run so triggered then had every operation refused (413)."""
    h: Harness = await make_engine(max_metadata_bytes=512)
    await h.deploy({"id": "hello"})
    async with api_client(h) as api:
        fits = await api.post("/api/v1/tasks/hello/trigger", json={"payload": {}, "options": {"metadata": {
            "a": "x" * 400}}})
        assert fits.status_code == 200, fits.text
        big = {"a": "x" * 600}
        refused = await api.post("/api/v1/tasks/hello/trigger", json={"payload": {}, "options": {"metadata": big}})
        assert refused.status_code == 413, refused.text
        assert refused.json()["error"]["message"].startswith("options.metadata: ")
        batch = await api.post("/api/v1/tasks/batch", json={"items": [
            {"task": "hello", "payload": {}}, {"task": "hello", "payload": {}, "options": {"metadata": big}}]})
        assert batch.status_code == 413, batch.text
        assert batch.json()["error"]["message"].startswith("items.1.options.metadata: ")
