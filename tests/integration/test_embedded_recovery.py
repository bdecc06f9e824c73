"""The embedded servers after a crash: what a SIGKILL or a power loss left behind (a stale
``postmaster.pid``, a data directory half made by initdb, a server nobody stops, another Redis on
the port) must not make the next start fail, hang or use the wrong server."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import psycopg
import pytest

from run_engine.embedded import EmbeddedPostgres, EmbeddedRedis
from run_engine.errors import ConfigurationError

ROOT = Path(__file__).resolve().parents[2]

HOLD = """
import sys, time
from pathlib import Path
from run_engine.embedded import EmbeddedPostgres
print(EmbeddedPostgres(Path(sys.argv[1])).start(), flush=True)
time.sleep(600)
"""


def postgres_of(pgdata: Path) -> list[psutil.Process]:
    """The postgres processes serving ``pgdata`` (the postmaster, by its command line)."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        if proc.info["name"] == "postgres" and str(pgdata) in (proc.info["cmdline"] or []):
            found.append(proc)
    return found


def wait_gone(procs: list[psutil.Process], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in procs):
        assert time.monotonic() < deadline, f"{what} still running: {procs}"
        time.sleep(0.05)


def alive(proc: psutil.Process) -> bool:
    """Running, or dead but not yet reaped (as the wheel sees it)."""
    try:
        return proc.is_running()
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def pgdata(tmp_path: Path) -> Iterator[Path]:
    """A data directory for an embedded PostgreSQL; whatever postgres serves it is stopped after."""
    path = tmp_path / ".run-engine" / "pgdata"
    yield path
    for proc in postgres_of(path):
        proc.kill()


def hold(pgdata: Path) -> subprocess.Popen[str]:
    """Another process (its own session) that starts the embedded PostgreSQL and keeps it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(pgdata)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, start_new_session=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("postgresql://")
    proc.stdout.close()
    return proc


def test_a_postgres_whose_holder_was_killed_is_stopped(pgdata: Path) -> None:
    """`run-engine dev` killed with SIGKILL left PostgreSQL running for good (the wheel stops it
    when its last holder exits, and the killed one never did)."""
    holder = hold(pgdata)
    try:
        servers = postgres_of(pgdata)
        assert servers
        holder.kill()  # the holder only: what `kill -9` of `run-engine dev` does
        holder.wait()
        wait_gone(servers, "the killed holder's postgres")
    finally:
        with contextlib.suppress(ProcessLookupError):  # (its watcher too, when it is one of the group)
            os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()


def test_a_postgres_left_by_a_killed_holder_is_stopped_by_the_next_one(pgdata: Path) -> None:
    """The holder killed with every process it started (a power loss of all but PostgreSQL): the
    next start uses the server left running and, unlike before, stops it when it is done."""
    holder = hold(pgdata)
    for proc in [*psutil.Process(holder.pid).children(recursive=True)]:
        proc.kill()
    holder.kill()
    holder.wait()
    again = EmbeddedPostgres(pgdata)
    with psycopg.connect(again.start()) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    servers = postgres_of(pgdata)
    again.stop()
    wait_gone(servers, "postgres after its last holder stopped")


def test_a_stale_postmaster_pid_naming_a_live_process_does_not_stop_the_start(pgdata: Path) -> None:
    """After a power loss, the pid in postmaster.pid may belong to another process by the next
    boot: the wheel took the server for running and the start failed, for good."""
    server = EmbeddedPostgres(pgdata)
    server.start()
    postmaster = postgres_of(pgdata)
    assert postmaster
    family = [*postmaster, *postmaster[0].children(recursive=True)]
    for proc in postmaster:
        proc.kill()
    wait_gone(family, "the crashed postgres")
    server.stop()  # nothing left to stop: forgets the handle
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        pid_file = pgdata / "postmaster.pid"
        lines = pid_file.read_text().splitlines()
        pid_file.write_text("\n".join([str(other.pid), *lines[1:]]) + "\n")
        again = EmbeddedPostgres(pgdata)
        with psycopg.connect(again.start(), connect_timeout=10) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        again.stop()
        assert other.poll() is None  # the process named in the stale file is left alone
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("seen", ["global", "PG_VERSION"])
def test_a_data_directory_half_made_by_a_killed_initdb_is_made_again(pgdata: Path, seen: str) -> None:
    """Killed while initdb ran (before or after it wrote PG_VERSION): every later start failed
    (initdb refuses a non-empty directory; pg_ctl cannot start a half-made one)."""
    pgdata.parent.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(pgdata)], stdout=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (pgdata / seen).exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.001)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the holder and its initdb: a power loss
        proc.wait()
    server = EmbeddedPostgres(pgdata)
    try:
        with psycopg.connect(server.start()) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        server.stop()


def test_an_embedded_redis_never_uses_another_redis_on_its_port(tmp_path: Path) -> None:
    """The port of the embedded Redis is fixed (6390): a second project's `run-engine dev` found
    it taken by the first one's Redis, whose PONG it took for its own, and shared its queues."""
    first = EmbeddedRedis(tmp_path / "a" / "redis")
    first.start()
    other = EmbeddedRedis(tmp_path / "b" / "redis", port=first.port)
    same = EmbeddedRedis(tmp_path / "a" / "redis", port=first.port)
    try:
        with pytest.raises(ConfigurationError, match=f"port {first.port} is in use by another redis-server"):
            other.start()
        assert same.start() == first.url  # the same data (another command of the same project): shared
        same.stop()
        import redis

        assert redis.Redis.from_url(first.url).ping()  # not stopped by the one that only shared it
    finally:
        other.stop()
        same.stop()
        first.stop()
