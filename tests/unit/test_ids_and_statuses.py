from __future__ import annotations

from run_engine.ids import new_id
from run_engine.statuses import FINAL_RUN_STATUSES, PUBLIC_STATUS, ExecutionStatus, RunStatus


def test_ids_are_prefixed_random_and_long() -> None:
    ids = {new_id("run") for _ in range(1000)}
    assert len(ids) == 1000
    assert all(i.startswith("run_") and len(i) >= 4 + 21 for i in ids)


def test_every_non_final_execution_status_has_a_public_status() -> None:
    assert set(PUBLIC_STATUS) == set(ExecutionStatus) - {ExecutionStatus.FINISHED}
    assert not FINAL_RUN_STATUSES & set(PUBLIC_STATUS.values())
    assert RunStatus.COMPLETED in FINAL_RUN_STATUSES
