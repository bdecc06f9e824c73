"""Task.batch_trigger answers a handle per payload, in order; items that made no run while the
others did (the answer's `errors`) raise BatchItemsFailedError with every handle in its place
(before, the handles were the runs made: fewer than the payloads, shifted, and nothing said why)."""

from __future__ import annotations

from typing import Any

import pytest

import run_engine.sdk.tasks as tasks_module
from run_engine.sdk import BatchItemsFailedError, RunHandle, Task
from run_engine.sdk.client import Answer


def noop(payload: Any) -> None:
    return None


async def test_a_batch_whose_middle_item_failed_alone_raises_with_the_others_in_their_places(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def answer(method: str, path: str, json: Any = None, **kwargs: Any) -> Answer:
        assert path == "/api/v1/tasks/batch" and len(json["items"]) == 3
        return Answer({"id": "batch_1", "runs": [{"id": "run_a", "taskIdentifier": "t", "isCached": False},
                                          {"id": "run_c", "taskIdentifier": "t", "isCached": True}],
                "errors": [{"index": 1, "taskIdentifier": "t", "error": "the run is busy",
                            "errorCode": "lock_timeout"}]}, resent=False)

    monkeypatch.setattr(tasks_module, "send", answer)
    with pytest.raises(BatchItemsFailedError) as failed:
        await Task(id="t", fn=noop).batch_trigger([1, 2, 3])
    assert failed.value.handles == [RunHandle("run_a", False), None, RunHandle("run_c", True)]
    assert failed.value.errors[0]["index"] == 1 and "item 1: lock_timeout" in str(failed.value)


async def test_a_batch_all_of_whose_items_made_runs_answers_their_handles(monkeypatch: pytest.MonkeyPatch) -> None:
    async def answer(method: str, path: str, json: Any = None, **kwargs: Any) -> Answer:
        return Answer({"id": "batch_1", "runs": [{"id": f"run_{i}", "taskIdentifier": "t", "isCached": False}
                                                 for i in range(len(json["items"]))]}, resent=False)

    monkeypatch.setattr(tasks_module, "send", answer)
    assert await Task(id="t", fn=noop).batch_trigger([1, 2]) == [RunHandle("run_0"), RunHandle("run_1")]
