"""A metadata request applied once however often it is sent: the SDK's flush carries an
``Idempotency-Key`` and sends a request whose answer was lost again as it was, with it; the server
remembers the last few keys of a run (``task_run.metadata_requests``, written in the transaction
that applies the operations) and answers a repeat with the metadata as it is. A request without a
key is applied each time it comes, as before."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

import run_engine.sdk.metadata as md_mod
from run_engine.engine import TriggerRequest
from run_engine.sdk.metadata import RunMetadata

from .conftest import Harness, api_client
from .test_metadata_operations import family, metadata, path
from .test_sdk_client import Breakable, lost_answer, unreachable, wire  # noqa: F401 - wire: a fixture


@pytest.fixture(autouse=True)
def no_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(md_mod, "SETTLE_BACKOFF_S", 0)


def sent(request: httpx.Request) -> tuple[str | None, object]:
    return request.headers.get("idempotency-key"), json.loads(request.content)


async def test_a_flush_whose_answer_was_lost_is_applied_once_on_the_run_its_parent_and_its_root(
        h: Harness, wire: Breakable) -> None:  # noqa: F811 - the fixture
    root, child, grandchild = await family(h)
    state = RunMetadata(grandchild.id, {}, asyncio.get_running_loop())
    state.change("metadata.increment", md_mod.OWN, "increment", "done", 1)
    state.change("metadata.append", md_mod.OWN, "append", "log", "first")
    state.change("metadata.parent.increment", md_mod.PARENT, "increment", "children", 1)
    state.change("metadata.root.increment", md_mod.ROOT, "increment", "total", 1)
    wire.faults = [lost_answer]  # applied and committed, its answer lost: the flush tries again
    await state.flush()
    assert await metadata(h, grandchild.id) == {"done": 1, "log": ["first"]}
    assert await metadata(h, child.id) == {"children": 1}
    assert await metadata(h, root.id) == {"seed": "root", "total": 1}
    assert state.current() == {"done": 1, "log": ["first"]}  # the server's answer to the repeat
    tries = [sent(r) for r in wire.seen]
    assert len(tries) == 2 and tries[0] == tries[1] and tries[0][0]  # the same request, with its key


async def test_a_request_kept_after_lost_answers_goes_again_whole_before_the_changes_made_since(
        h: Harness, wire: Breakable) -> None:  # noqa: F811 - the fixture
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    state = RunMetadata(run.id, {}, asyncio.get_running_loop())
    state.change("metadata.increment", md_mod.OWN, "increment", "done", 1)
    wire.faults = [lost_answer] * md_mod.SETTLE_TRIES  # applied, then never answered
    with pytest.raises(Exception, match="answer was lost"):
        await state.flush()
    assert await metadata(h, run.id) == {"done": 1}
    state.change("metadata.increment", md_mod.OWN, "increment", "done", 1)  # would fold into the kept one
    assert state.current() == {"done": 2}
    wire.faults = [unreachable]  # never reached the server: tried again
    await state.flush()
    assert await metadata(h, run.id) == {"done": 2} and state.current() == {"done": 2}
    tries = [sent(r) for r in wire.seen]
    assert len(tries) == md_mod.SETTLE_TRIES + 3
    first, *again, later = tries
    assert all(t == first for t in again)  # the kept request, whole, with its key, every time
    assert later[0] != first[0] and later[1] == {"operations": [{"type": "increment", "key": "done", "value": 1}],
                                                 "parentOperations": [], "rootOperations": []}


async def test_the_server_remembers_a_runs_last_keys_in_the_transaction_that_applies_them(
        h: Harness, api: httpx.AsyncClient) -> None:
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello",
                                                metadata={"items": [0, 0]}))
    bump = {"operations": [{"type": "increment", "key": "n", "value": 1}]}

    async def put(body: dict[str, object], key: str | None = None) -> httpx.Response:
        return await api.put(path(run.id), json=body, headers={"Idempotency-Key": key} if key else {})

    # without a key: each request applied, as before
    assert (await put(bump)).json() == {"metadata": {"items": [0, 0], "n": 1}}
    assert (await put(bump)).json() == {"metadata": {"items": [0, 0], "n": 2}}
    # with one: once; a repeat is answered with the metadata as it is then
    assert (await put(bump, "k0")).json()["metadata"]["n"] == 3
    await put({"operations": [{"type": "set", "key": "other", "value": True}]})
    assert (await put(bump, "k0")).json() == {"metadata": {"items": [0, 0], "n": 3, "other": True}}
    # its key with another body: 409, nothing applied
    conflict = await put({"operations": [{"type": "increment", "key": "n", "value": 5}]}, "k0")
    assert conflict.status_code == 409 and "Idempotency-Key" in conflict.json()["error"]["message"]
    # a request refused while applied is not remembered: its key is free
    refused = await put({"operations": [{"type": "set", "key": "$.items.5", "value": 1}]}, "k-refused")
    assert refused.status_code == 400, refused.text
    assert (await put(bump, "k-refused")).json()["metadata"]["n"] == 4
    # parent and root operations alone (the run's own metadata unchanged) are remembered too
    assert (await put({"parentOperations": [{"type": "increment", "key": "n", "value": 1}]}, "k-parent")
            ).json()["metadata"]["n"] == 5  # a run without a parent is its own parent
    assert (await put({"parentOperations": [{"type": "increment", "key": "n", "value": 1}]}, "k-parent")
            ).json()["metadata"]["n"] == 5
    # a replacement with a key, too
    assert (await put({"metadata": {"n": 0}}, "k-replace")).json() == {"metadata": {"n": 0}}
    await put(bump)
    assert (await put({"metadata": {"n": 0}}, "k-replace")).json() == {"metadata": {"n": 1}}
    # bounded: the last few keys only
    for i in range(1, 9):
        await put(bump, f"k{i}")
    assert (await metadata(h, run.id))["n"] == 9
    assert (await put(bump, "k8")).json()["metadata"]["n"] == 9  # remembered
    assert (await put(bump, "k-refused")).json()["metadata"]["n"] == 10  # forgotten: applied again
    too_long = await put(bump, "k" * 257)
    assert too_long.status_code == 400 and "Idempotency-Key" in too_long.text


async def test_a_repeat_sent_while_its_first_try_is_under_way_is_applied_once(h: Harness) -> None:
    """A try that timed out on the client's side may still be applied while the next one comes: the
    second waits for the run's row lock, and reads the key the first noted under it."""
    root, _, grandchild = await family(h)
    body = {"operations": [{"type": "increment", "key": "n", "value": 1}],
            "rootOperations": [{"type": "increment", "key": "n", "value": 1}]}
    async with api_client(h) as api:
        for i in range(5):
            answers = await asyncio.gather(*(api.put(path(grandchild.id), json=body,
                                                     headers={"Idempotency-Key": f"same-{i}"}) for _ in range(4)))
            assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    assert await metadata(h, grandchild.id) == {"n": 5}
    assert (await metadata(h, root.id))["n"] == 5
