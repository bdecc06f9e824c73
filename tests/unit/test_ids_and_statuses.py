from __future__ import annotations

import os
import re
from collections import Counter

from run_engine.ids import new_id
from run_engine.statuses import FINAL_RUN_STATUSES, PUBLIC_STATUS, ExecutionStatus, RunStatus


def test_ids_are_prefixed_random_and_long() -> None:
    ids = {new_id("run") for _ in range(10_000)}  # many batches of the pool
    assert len(ids) == 10_000
    assert all(re.fullmatch(r"run_[a-z2-7]{24}", i) for i in ids)


def test_every_symbol_of_an_id_is_equally_likely() -> None:
    # 240,000 characters: each of the 32 symbols 7,500 times expected (sd ~85); a bias such as a
    # symbol of b % 26 or a fixed character would be thousands off
    counts = Counter("".join(new_id("run")[4:] for _ in range(10_000)))
    assert set(counts) == set("abcdefghijklmnopqrstuvwxyz234567")
    assert all(abs(n - 7_500) < 750 for n in counts.values()), counts


def test_a_forked_child_never_hands_out_its_parents_ids() -> None:
    new_id("run")  # the pool holds ids now; a fork copies them
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        os.write(write, "\n".join(new_id("run") for _ in range(100)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        child = set(f.read().split("\n"))
    os.waitpid(pid, 0)
    parent = {new_id("run") for _ in range(100)}
    assert len(child) == 100 and not child & parent


def test_every_non_final_execution_status_has_a_public_status() -> None:
    assert set(PUBLIC_STATUS) == set(ExecutionStatus) - {ExecutionStatus.FINISHED}
    assert not FINAL_RUN_STATUSES & set(PUBLIC_STATUS.values())
    assert RunStatus.COMPLETED in FINAL_RUN_STATUSES
