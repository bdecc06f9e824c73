"""The short chaos run (issue 11): its own embedded PostgreSQL and Redis, two servers, three
supervisors, a few hundred seeded runs, and each kind of fault once (executor, supervisor and
server SIGKILLs, Redis killed and restarted, FLUSHALL, the PostgreSQL postmaster killed and
restarted, Redis paused past the lock TTL). Nothing may be lost or run twice."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1200)  # about 100 s; the suite's 120 s default is too close
def test_short_chaos_run_loses_and_duplicates_nothing() -> None:
    proc = subprocess.run([sys.executable, "bench/chaos.py", "--short", "--seed", "11"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1] == "chaos lost+duplicated: 0", proc.stdout[-6000:] + proc.stderr[-4000:]
    assert proc.returncode == 0
    injected = {line.split()[0]: int(line.split()[1]) for line in lines
                if line.split()[:1] and line.split()[0] in {"executor", "supervisor", "server", "redis-kill",
                                                             "flushall", "postgres-kill", "redis-pause"}}
    assert len(injected) == 7 and all(n == 1 for n in injected.values()), injected
