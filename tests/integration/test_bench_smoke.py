"""`bench/lifecycle.py` (what `bench/peers.py` runs as "run-engine in process") runs with its
defaults and ends with its last line: a default that broke it (an argument's default read off the
slots dataclass of the settings, not a number) failed only the peers benchmark."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mode", [[], ["--enqueue-first", "--start-in-dequeue"], ["--gc-threshold", "0"]])
def test_the_lifecycle_benchmark_runs_and_prints_its_last_line(database_server: str, standalone_redis_url: str,
                                                              mode: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "bench/lifecycle.py", "--runs", "40", "--producers", "2", "--consumers", "2", *mode],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DATABASE_URL": database_server,
             "REDIS_URL": standalone_redis_url})
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.fullmatch(r"lifecycle runs/s: \d+", out.stdout.strip().splitlines()[-1]), out.stdout[-500:]


def test_the_retry_flood_measurement_runs_and_finds_the_victim_first(standalone_redis_url: str) -> None:
    """`bench/fairness.py --only retries` (the run queue alone): another tenant's run due a moment
    after a flood of retries comes out in the first dequeue call, and the keys are cleaned up."""
    out = subprocess.run(
        [sys.executable, "bench/fairness.py", "--only", "retries", "--flood", "2000"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "REDIS_URL": standalone_redis_url})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "retry victim dequeue calls: 1", out.stdout[-500:]
