"""Fire-and-forget triggers inside a task across a restore (real server and supervisors). A
suspended run is restored by running its task from the start again, the journal replaying its
steps and waits; ``trigger`` and ``batch_trigger`` are not journaled, so each restore triggered
the children again (a second child run per restore: found by a review of the in-task SDK). Each
now carries a key of the attempt's own (``sdk:<run>:<attempt>:…``), the same on every execution of
the attempt: a restore gets back the runs its first execution made; a retry (another attempt)
triggers anew."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .conftest import Stack
from .test_waits_e2e import complete_token, create_token, until_suspended

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


@pytest.fixture(scope="module")
def triggering(stack: Stack) -> Stack:
    own = stack.project("intask-triggers")
    own.start_supervisor("intask", concurrency=4)
    return own


def children(s: Stack, run_id: str) -> list[str]:
    """The runs the run triggered (each tagged with its id)."""
    with s.client() as c:
        r = c.get("/api/v1/runs", params={"filter[tag]": run_id, "page[size]": "100"})
    assert r.status_code == 200, r.text
    return sorted(run["id"] for run in r.json()["data"])


def seen(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_a_restored_run_gets_back_the_children_it_triggered_instead_of_triggering_more(
        triggering: Stack, tmp_path: Path) -> None:
    log = tmp_path / "seen.log"
    token = create_token(triggering)
    run_id = triggering.trigger("triggers-then-waits", {"log": str(log), "token": token["id"]})
    until_suspended(triggering, run_id)
    complete_token(triggering, token["id"], "go")
    run = triggering.wait_for(run_id)
    assert run["status"] == "COMPLETED" and run["attemptCount"] == 1, run
    first, restored = seen(log)  # run from its start twice: first, then restored after the token
    assert restored == first  # the same five runs, each the call's own (is_cached False both times)
    assert first["cached"] == [False] * 4 and len(set(first["runs"])) == 5
    assert children(triggering, run_id) == sorted(first["runs"])  # before: ten (five more on the restore)
    assert run["output"] == first


def test_a_retry_triggers_anew_what_is_not_in_a_step(triggering: Stack, tmp_path: Path) -> None:
    log = tmp_path / "seen.log"
    token = create_token(triggering)
    run_id = triggering.trigger("triggers-then-waits", {"log": str(log), "token": token["id"],
                                                        "fail_first": True})
    until_suspended(triggering, run_id)
    complete_token(triggering, token["id"], "go")
    run = triggering.wait_for(run_id)
    assert run["status"] == "COMPLETED" and run["attemptCount"] == 2, run
    first, restored, retried = seen(log)
    assert restored == first and first["attempt"] == 1 and retried["attempt"] == 2
    # the step's child is journaled (the retry replays it); the other triggers are the attempt's
    assert retried["runs"][1] == first["runs"][1]
    assert not set(retried["runs"][:1] + retried["runs"][2:]) & set(first["runs"])
    assert retried["cached"] == [False] * 4
    assert children(triggering, run_id) == sorted({*first["runs"], *retried["runs"]})  # 9; before: 13
