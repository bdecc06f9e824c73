"""A batch wait's journal entry names its runs; an entry without them (written before waits of
kind batch were checked) reads as a batch of none instead of failing every read of the journal."""

from __future__ import annotations

from typing import Any

import pytest

from systems.waitpoints import batch_runs, is_batch_entry


@pytest.mark.parametrize(("result", "runs"), [
    ({"runIds": ["run_a", "run_b"]}, ["run_a", "run_b"]),
    (None, []), ({}, []), ({"runIds": None}, []), ({"runIds": "run_a"}, []), ([1, 2], []),
    ({"runIds": ["run_a", 7, None]}, ["run_a"]),
])
def test_the_runs_of_a_batch_entry(result: Any, runs: list[str]) -> None:
    assert batch_runs(result) == runs
    assert is_batch_entry(result) == (isinstance(result, dict) and isinstance(result.get("runIds"), list))


class _Channel:
    """The executor's channel to its supervisor, answering the next page of the journal."""

    def __init__(self, pages: dict[int, dict[str, Any]]) -> None:
        self.pages = pages
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def call(self, op: str, **data: Any) -> dict[str, Any]:
        import asyncio

        self.calls.append((op, data))
        await asyncio.sleep(0.01)
        return self.pages[data["sequence"]] if op == "journal_page" else {}


def _step(seq: int, result: Any) -> dict[str, Any]:
    return {"sequence": seq, "kind": "step", "key": f"s{seq}", "resolved": True, "result": result}


async def test_a_replay_asks_for_the_journals_next_page_when_it_gets_there() -> None:
    import asyncio

    from run_engine.sdk.runtime import Runtime

    channel = _Channel({2: {"journal": [_step(2, "C"), _step(3, "D")], "next": 4},
                        4: {"journal": [_step(4, "E")], "next": None}})
    rt = Runtime(channel, [_step(0, "A"), _step(1, "B")], journal_next=2)  # type: ignore[arg-type]

    def never() -> str:
        raise AssertionError("replayed steps are not run again")

    assert [await rt.step("s0", never), await rt.step("s1", never)] == ["A", "B"] and channel.calls == []
    # two steps at once past the page: one request for the next page, each its own entry
    assert await asyncio.gather(rt.step("s2", never), rt.step("s3", never)) == ["C", "D"]
    assert await rt.step("s4", never) == "E"
    assert [c for c in channel.calls if c[0] == "journal_page"] == [("journal_page", {"sequence": 2}),
                                                                     ("journal_page", {"sequence": 4})]
    assert rt.journal == {}  # each entry let go once replayed: a page at most is held
    assert await rt.step("s5", lambda: "new") == "new"  # past the journal: run and journaled
    assert channel.calls[-1] == ("journal", {"sequence": 5, "key": "s5", "result": "new"})
