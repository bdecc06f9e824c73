"""`run-engine dev` killed with SIGKILL (a crash, the OOM killer, `kill -9`): nothing it started
may keep running, and the next `run-engine dev` in the same folder starts as usual."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from .conftest import ROOT, free_port, stop


def start_dev(cwd: Path, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "REDIS_URL", "RUN_ENGINE_SECRET", "RUN_ENGINE_KEY_PREFIX")}
    env.update({"RUN_ENGINE_REDIS_PORT": "0", "PYTHONPATH": str(ROOT)})
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "run_engine.cli", "dev", "--port", str(port)], cwd=cwd,
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 90
    while not re.search(r"API key\s+tr_dev_\w+(.|\n)*connected as dev", log_path.read_text()):
        assert proc.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.1)
    return proc


def started_by(proc: subprocess.Popen[bytes], data: Path) -> list[psutil.Process]:
    """Everything the dev process runs: its descendants and the postgres of its data folder."""
    found = psutil.Process(proc.pid).children(recursive=True)
    for p in psutil.process_iter(["name", "cmdline"]):
        if p.info["name"] == "postgres" and str(data / "pgdata") in (p.info["cmdline"] or []):
            found.append(p)
    return found


def running(procs: list[psutil.Process]) -> list[psutil.Process]:
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.NoSuchProcess:
            pass
    return left


def test_dev_killed_leaves_nothing_running_and_starts_again(tmp_path: Path) -> None:
    port = free_port()
    data = (tmp_path / ".run-engine").resolve()
    first = start_dev(tmp_path, port, tmp_path / "dev-1.log")
    procs = started_by(first, data)
    try:
        names = " ".join(" ".join(p.cmdline()) for p in procs)
        assert "redis-server" in names and "supervisor" in names and "postgres" in names, names
        first.kill()  # dev alone, as `kill -9 PID` or the OOM killer would
        first.wait()
        deadline = time.monotonic() + 90
        while left := running(procs):
            assert time.monotonic() < deadline, f"left running after dev was killed: {left}"
            time.sleep(0.1)
        again = start_dev(tmp_path, port, tmp_path / "dev-2.log")
        procs += started_by(again, data)
        assert stop(again, signal.SIGINT, timeout=60) == 0, (tmp_path / "dev-2.log").read_text()[-3000:]
    finally:
        for p in running(procs):
            p.kill()
