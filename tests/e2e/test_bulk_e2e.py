"""Bulk cancel and replay over HTTP against the real server: the engine job works through the
matching runs a page at a time while the progress is read; the same idempotency key answers with
the same action; bad filters are 400s; another environment cannot read an action."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from .conftest import Stack


@pytest.fixture(scope="module")
def hand(stack: Stack) -> Stack:
    """A project that no supervisor serves: its runs stay QUEUED until cancelled."""
    own = stack.project("bulk")
    with own.worker() as w:
        r = w.post("/engine/v1/worker-actions/connect", json={"workerInstanceName": "hand",
                                                              "deployment": {"tasks": [{"id": "echo"}]}})
        assert r.status_code == 200, r.text
    return own


def _batch(c: httpx.Client, n: int, tag: str) -> list[str]:
    r = c.post("/api/v1/tasks/batch", json={"items": [{"task": "echo", "payload": {"i": i}, "options": {"tags": [tag]}}
                                                      for i in range(n)]})
    assert r.status_code == 200, r.text
    return [run["id"] for run in r.json()["runs"]]


def _finish(c: httpx.Client, action_id: str) -> tuple[dict[str, Any], list[int]]:
    seen: list[int] = []
    deadline = time.monotonic() + 60
    while True:
        got = c.get(f"/api/v1/runs/bulk/{action_id}")
        assert got.status_code == 200, got.text
        action: dict[str, Any] = got.json()
        seen.append(action["processed"])
        if action["status"] == "COMPLETED":
            return action, seen
        assert time.monotonic() < deadline, action
        time.sleep(0.05)


def _count(c: httpx.Client, **filters: str) -> int:
    total, after = 0, None
    while True:
        params = {f"filter[{k}]": v for k, v in filters.items()} | {"page[size]": "100"}
        if after:
            params["page[after]"] = after
        page = c.get("/api/v1/runs", params=params).json()
        total += len(page["data"])
        after = page["pagination"].get("next")
        if not after:
            return total


def test_bulk_cancel_then_replay_with_progress(hand: Stack, stack: Stack) -> None:
    with hand.client() as c:
        _batch(c, 250, "sweep")
        kept = _batch(c, 3, "keep")
        made = c.post("/api/v1/runs/bulk/cancel", json={"filter": {"tag": ["sweep"]}},
                      headers={"Idempotency-Key": "sweep-1"})
        assert made.status_code == 200, made.text
        action = made.json()
        assert action["type"] == "CANCEL" and action["isCached"] is False and action["filter"] == {"tags": ["sweep"]}
        again = c.post("/api/v1/runs/bulk/cancel", json={"filter": {"tag": ["sweep"]}, "idempotencyKey": "sweep-1"})
        assert again.json()["id"] == action["id"] and again.json()["isCached"] is True
        done, seen = _finish(c, action["id"])
        assert done["processed"] == 250 and done["succeeded"] == 250 and done["completedAt"]
        assert seen == sorted(seen)  # progress only grows
        assert _count(c, tag="sweep", status="CANCELED") == 250
        assert {hand.run(r)["status"] for r in kept} == {"QUEUED"}
        # replay the cancelled ones: 250 new runs, and the replays are not replayed
        replay = c.post("/api/v1/runs/bulk/replay", json={"filter": {"tag": ["sweep"], "status": ["CANCELED"]}}).json()
        done, _ = _finish(c, replay["id"])
        assert (done["processed"], done["succeeded"]) == (250, 250)
        assert _count(c, tag="sweep", status="QUEUED") == 250
        # the same key for another kind of action is a conflict, not a silent reuse
        clash = c.post("/api/v1/runs/bulk/replay", json={"filter": {"tag": ["sweep"]}, "idempotencyKey": "sweep-1"})
        assert clash.status_code == 409
    # another environment cannot read it
    other = stack.project("bulk-other")
    with other.client() as c:
        assert c.get(f"/api/v1/runs/bulk/{action['id']}").status_code == 404


def test_bad_bulk_requests_are_400s(hand: Stack) -> None:
    with hand.client() as c:
        for bad, word in (({}, "empty filter"), ({"filter": {}}, "empty filter"),
                          ({"filter": {"status": ["NOPE"]}}, "unknown status"),
                          ({"filter": {"createdAt": {"from": "someday"}}}, "filter.createdAt.from"),
                          ({"filter": {"tag": "not-a-list"}}, "filter.tag")):
            r = c.post("/api/v1/runs/bulk/cancel", json=bad)
            assert r.status_code == 400 and word in r.json()["error"]["message"], (bad, r.text)
        assert c.get("/api/v1/runs/bulk/bulk_nope").status_code == 404
        assert c.get("/api/v1/runs/bulk/run_aaaaaaaaaaaaaaaaaaaaaaaa").status_code == 404
