"""A wait on a run by its id (``wait.for_run``) that names the waiting run itself or a run it
descends from: that run finishes only after the wait, which therefore never ended (the waiter
stayed WAITING for good, a deadlock its user only saw as a stuck run). It now ends at once with a
``WAIT_DEADLOCK`` error, journaled like any run's outcome, as a child's idempotency key naming an
ancestor already did (test_waitpoints.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from run_engine.engine import TriggerRequest

from .conftest import Harness, api_client

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)

W = "/engine/v1/worker-actions"


@pytest.fixture
async def worker(h: Harness) -> Any:
    """The worker API over the harness's engine, with the worker group's token."""
    async with api_client(h, h.env.worker_group_token) as c:
        yield c


def req(h: Harness, **kw: Any) -> TriggerRequest:
    return TriggerRequest(env_id=h.env.env_id, task_id="hello", **kw)


async def start(h: Harness, *run_ids: str) -> dict[str, str]:
    """Dequeue and start ``run_ids``: their executing snapshots' ids."""
    got = {d.run.id: d for d in await h.engine.dequeue(h.env.worker_group_id, 10)}
    return {r: (await h.engine.start_attempt(r, got[r].snapshot.id)).snapshot.id for r in run_ids}


async def family(h: Harness, children: int = 1) -> tuple[str, str, list[str], dict[str, str]]:
    """A grandparent waiting on its parent, waiting on ``children`` children (trigger and wait,
    as tasks make them): the ids, and the children's executing snapshots."""
    grandparent = (await h.engine.trigger(req(h))).id
    at = await start(h, grandparent)
    (parent,), _ = await h.engine.trigger_and_wait(grandparent, at[grandparent], 0, [req(h)])
    at = await start(h, parent)
    kids, _ = await h.engine.trigger_and_wait(parent, at[parent], 0, [req(h)] * children, batch=children > 1)
    return grandparent, parent, kids, await start(h, *kids)


async def wait_on_run(h: Harness, waiter: str, snapshot_id: str, target: str, sequence: int = 0) -> Any:
    """What the worker API's wait does with a run id: the run's waitpoint, then the block."""
    wp = await h.engine.run_waitpoint(h.env.env_id, target, waiter_id=waiter)
    return await h.engine.block(waiter, snapshot_id, sequence=sequence, kind="token",
                                key=wp.completed_by_run_id or wp.id, waitpoint_ids=[wp.id])


def deadlock(entry: Any, target: str) -> None:
    assert entry is not None and entry["resolved"] and entry["key"] == target, entry
    result = entry["result"]
    assert result["ok"] is False and result["error"]["type"] == "WAIT_DEADLOCK", result
    assert target in result["error"]["message"] and "cannot wait on itself" in result["error"]["message"]


async def test_a_wait_on_itself_its_parent_or_grandparent_ends_at_once_with_an_error(h: Harness) -> None:
    grandparent, parent, (child,), at = await family(h)
    snapshot = at[child]
    for sequence, target in enumerate((child, parent, grandparent)):  # before: blocked for ever
        outcome = await wait_on_run(h, child, snapshot, target, sequence)
        assert not outcome.blocked and outcome.snapshot.engine_status == "EXECUTING"
        deadlock(outcome.entry, target)
        snapshot = outcome.snapshot.id
    # the run goes on: a wait on a run it does not descend from blocks as ever
    other = (await h.engine.trigger(req(h))).id
    outcome = await wait_on_run(h, child, snapshot, other, 3)
    assert outcome.blocked and (await h.engine.get_run(child)).status == "WAITING"  # type: ignore[union-attr]
    # a replay reads the same answers from the journal
    journal = (await h.engine.resolved_journal(child)).entries
    for entry, target in zip(journal, (child, parent, grandparent), strict=False):
        deadlock(entry, target)
    assert journal[3]["resolved"] is False


async def test_the_ancestors_own_waitpoints_are_left_to_their_other_waiters(h: Harness) -> None:
    """The error is the waiter's alone: a run that may wait on the ancestor waits for its output."""
    grandparent, _, (child,), at = await family(h)
    deadlock((await wait_on_run(h, child, at[child], grandparent)).entry, grandparent)
    other = (await h.engine.trigger(req(h))).id
    at = await start(h, other)
    outcome = await wait_on_run(h, other, at[other], grandparent)
    assert outcome.blocked
    (shared,) = await h.engine.blocking_waitpoints(other)
    assert shared.status == "PENDING" and shared.completed_by_run_id == grandparent


async def test_a_finished_ancestor_is_waited_on_as_any_finished_run(h: Harness) -> None:
    """A run that did not wait for its child (triggered with parentRunId, not waited on) may finish
    first: a wait on it afterwards is no deadlock and gets its output."""
    root = (await h.engine.trigger(req(h))).id
    at = await start(h, root)
    child = (await h.engine.trigger(req(h, parent_run_id=root, root_run_id=root, depth=1))).id
    await h.engine.complete_attempt(root, at[root], ok=True, output={"done": 1})
    at = await start(h, child)
    outcome = await wait_on_run(h, child, at[child], root)
    assert not outcome.blocked and outcome.entry["result"] == {"ok": True, "output": {"done": 1}}


async def test_a_child_its_parent_did_not_wait_for_may_wait_for_its_parent(h: Harness) -> None:
    """A child triggered with a parent that does not wait on it (parentRunId alone): the parent may
    finish first, so the child's wait on it (or on the grandparent above) blocks as any wait on a
    run does, and ends with the parent's output."""
    root = (await h.engine.trigger(req(h))).id
    at = await start(h, root)
    child = (await h.engine.trigger(req(h, parent_run_id=root, root_run_id=root, depth=1))).id
    at_child = await start(h, child)
    outcome = await wait_on_run(h, child, at_child[child], root)
    assert outcome.blocked and (await h.engine.get_run(child)).status == "WAITING"  # type: ignore[union-attr]
    await h.engine.complete_attempt(root, at[root], ok=True, output={"done": 2})
    (shared,) = await h.engine.blocking_waitpoints(child) or [None]
    assert shared is None or shared.status == "COMPLETED"
    journal = (await h.engine.resolved_journal(child)).entries
    assert journal[0]["result"] == {"ok": True, "output": {"done": 2}}


async def test_the_worker_api_answers_a_wait_on_an_ancestor_with_the_error_alone_per_item(
        h: Harness, worker: httpx.AsyncClient) -> None:
    """``…/waitpoints/{runId}/wait`` and ``POST /waits``: the wait on the run itself (a 400 before)
    or an ancestor is answered 200, over at once with the error, journaled (the SDK's
    ``wait.for_run`` returns it, not ok, and a replay reads it again); the other items of the batch
    wait as they would alone."""
    grandparent, parent, kids, at = await family(h, children=3)
    first, second, third = kids
    other = (await h.engine.trigger(req(h))).id
    at |= await start(h, other)
    one = await worker.post(f"{W}/runs/{first}/snapshots/{at[first]}/waitpoints/{parent}/wait",
                            json={"sequence": 0, "kind": "token"})
    assert one.status_code == 200, one.text
    body = one.json()
    assert body["blocked"] is False and body["snapshot"]["executionStatus"] == "EXECUTING"
    deadlock(body["entry"], parent)
    r = await worker.post(f"{W}/waits", json={"items": [
        {"runId": second, "snapshotId": at[second], "waitpointId": grandparent, "sequence": 0, "kind": "token"},
        {"runId": other, "snapshotId": at[other], "waitpointId": parent, "sequence": 0, "kind": "token"},
        {"runId": third, "snapshotId": at[third], "waitpointId": third, "sequence": 0, "kind": "token"}]})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["ok"] for x in results] == [True, True, True], results
    deadlock(results[0]["entry"], grandparent)
    assert results[1]["blocked"] is True and "entry" not in results[1]  # not its ancestor: it waits
    deadlock(results[2]["entry"], third)
    journal = await worker.get(f"{W}/runs/{third}/journal")
    deadlock(journal.json()["journal"][0], third)
    statuses = {run_id: (await h.engine.get_run(run_id)).status  # type: ignore[union-attr]
                for run_id in (first, second, third, other)}
    assert statuses == {first: "EXECUTING", second: "EXECUTING", third: "EXECUTING", other: "WAITING"}


async def test_a_wait_on_an_unrelated_run_costs_one_look_up_of_the_waiter(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check reads the waiter's row, by key, once; its parent chain only when the run waited
    on is in its tree, above it (a child of a deep tree waiting on a run of another tree reads
    nothing more)."""
    _, _, (child,), at = await family(h)
    other = (await h.engine.trigger(req(h))).id
    runs = h.engine.resources.repo.runs
    read: list[tuple[str, bool]] = []
    real = runs.get_run

    async def counted(run_id: str, env_id: str | None = None, *, light: bool = False) -> Any:
        read.append((run_id, light))
        return await real(run_id, env_id, light=light)

    monkeypatch.setattr(runs, "get_run", counted)
    assert (await wait_on_run(h, child, at[child], other)).blocked
    assert [r for r in read if r[1]] == [(child, True)]


async def test_a_deep_ancestor_is_found_by_its_chain_read_no_further_than_it(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Five generations: the fifth waits on the second, which is neither its parent nor its root."""
    ids = [(await h.engine.trigger(req(h))).id]
    at = await start(h, ids[0])
    for _ in range(4):
        (kid,), _ = await h.engine.trigger_and_wait(ids[-1], at[ids[-1]], 0, [req(h)])
        ids.append(kid)
        at = await start(h, kid)
    runs = h.engine.resources.repo.runs
    read: list[str] = []
    real = runs.get_run

    async def counted(run_id: str, env_id: str | None = None, *, light: bool = False) -> Any:
        if light:
            read.append(run_id)
        return await real(run_id, env_id, light=light)

    monkeypatch.setattr(runs, "get_run", counted)
    deadlock((await wait_on_run(h, ids[4], at[ids[4]], ids[1])).entry, ids[1])
    assert read == [ids[4], ids[3], ids[2]]  # the waiter, then up to the second's child


async def test_a_repeat_of_the_wait_whose_answer_was_lost_is_a_duplicate_of_it(h: Harness,
                                                                               worker: httpx.AsyncClient) -> None:
    """The supervisor repeats a wait whose answer it did not get: the repeat finds the journaled
    wait (409, which it resolves from the journal), and no second entry is written."""
    _, parent, (child,), at = await family(h)
    path = f"{W}/runs/{child}/snapshots/{at[child]}/waitpoints/{parent}/wait"
    assert (await worker.post(path, json={"sequence": 0, "kind": "token"})).status_code == 200
    again = await worker.post(path, json={"sequence": 0, "kind": "token"})
    assert again.status_code == 409, again.text
    journal = (await worker.get(f"{W}/runs/{child}/journal")).json()["journal"]
    assert len(journal) == 1
    deadlock(journal[0], parent)
