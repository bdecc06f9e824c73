"""A replay that makes another wait than the journal recorded at a position is found out
(NonDeterminismError) instead of being handed that position's result: a token or run waited on in
another order (a loop over a set, whose order differs from one process to another), or a batch of
another size. From a review of the SDK runtime."""

from __future__ import annotations

from typing import Any

import pytest

from run_engine.sdk import NonDeterminismError, task, wait
from run_engine.sdk import runtime as rt_mod
from run_engine.sdk.runtime import Runtime


class _Channel:
    """The supervisor's side: records what the replay asks (a wait re-blocked on its waitpoint)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def call(self, op: str, **data: Any) -> dict[str, Any]:
        self.calls.append((op, data))
        return {"result": {"ok": True, "output": f"answer of {data.get('waitpointId')}"}}


def _token(seq: int, key: str, output: Any = None, resolved: bool = True) -> dict[str, Any]:
    if not resolved:
        return {"sequence": seq, "kind": "token", "key": key, "resolved": False, "waitpointId": key}
    return {"sequence": seq, "kind": "token", "key": key, "resolved": True, "result": {"ok": True, "output": output}}


async def _in(journal: list[dict[str, Any]], fn: Any) -> tuple[Any, _Channel]:
    channel = _Channel()
    token = rt_mod.activate(Runtime(channel, journal))  # type: ignore[arg-type]
    try:
        return await fn(), channel
    finally:
        rt_mod._current.reset(token)


JOURNAL = [_token(0, "waitpoint_a", "A"), _token(1, "waitpoint_b", "B")]


async def test_tokens_replayed_in_their_order_get_their_results() -> None:
    async def same() -> list[Any]:
        return [(await wait.for_token("waitpoint_a")).output, (await wait.for_token("waitpoint_b")).output]

    assert (await _in(JOURNAL, same))[0] == ["A", "B"]


async def test_a_replay_waiting_on_another_token_at_a_position_is_not_given_its_result() -> None:
    """Before: the wait on waitpoint_b got waitpoint_a's output (and the next one waitpoint_b's)."""
    async def swapped() -> Any:
        return (await wait.for_token("waitpoint_b")).output

    with pytest.raises(NonDeterminismError, match="waitpoint_a"):
        await _in(JOURNAL, swapped)


async def test_a_replay_waiting_on_another_run_at_a_position_is_not_given_its_result() -> None:
    journal = [_token(0, "run_one", "output of run_one")]  # wait.for_run: the entry's key is the run

    async def other() -> Any:
        return (await wait.for_run("run_two")).output

    with pytest.raises(NonDeterminismError, match="run_one"):
        await _in(journal, other)


async def test_a_replay_waiting_on_another_token_does_not_block_on_the_recorded_one() -> None:
    """A journaled wait still pending: before, the replay re-blocked on the recorded waitpoint
    (waitpoint_a) and its answer was handed to the wait on waitpoint_b."""
    async def other() -> Any:
        return (await wait.for_token("waitpoint_b")).output

    with pytest.raises(NonDeterminismError, match="waitpoint_a"):
        await _in([_token(0, "waitpoint_a", resolved=False)], other)


@task(id="divergence-child")
async def _child(payload: Any) -> Any:
    return payload


async def test_a_replayed_batch_of_another_size_is_not_given_the_recorded_results() -> None:
    """Before: a batch of three replayed at the position of a batch of two got two results."""
    recorded = [{"ok": True, "id": f"run_{i}", "output": i} for i in range(2)]
    journal = [{"sequence": 0, "kind": "batch", "key": "batch_x", "resolved": True, "result": recorded}]

    async def same() -> Any:
        return [r.output for r in await _child.batch_trigger_and_wait([0, 1])]

    assert (await _in(journal, same))[0] == [0, 1]

    async def bigger() -> Any:
        return await _child.batch_trigger_and_wait([0, 1, 2])

    with pytest.raises(NonDeterminismError, match="3"):
        await _in(journal, bigger)
