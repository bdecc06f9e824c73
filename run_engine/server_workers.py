"""``run-engine server --workers N``: N server processes on one port.

The parent binds the listening socket once and starts N ``run-engine server --fd`` children that
accept on it (the kernel hands each connection to one of them); everything else they share goes
through PostgreSQL and Redis already (long-polls, realtime, leader duties, the cron planner), as it
does between servers on several hosts. The parent only watches: a child that dies is started again
(after a back-off that grows while children keep dying quickly), and SIGINT/SIGTERM stop them all
gracefully. Counters of /metrics are shared through a ``PROMETHEUS_MULTIPROC_DIR`` the parent makes
when none is set.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

#: a child that lived this long before it died is restarted at once; quicker deaths back off
HEALTHY_AFTER_S = 30.0
MAX_BACKOFF_S = 30.0
STOP_TIMEOUT_S = 30.0


def bind(host: str, port: int) -> socket.socket:
    """The listening socket the children share (inheritable)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


@dataclass
class _Child:
    slot: int
    proc: subprocess.Popen[bytes]
    started: float = field(default_factory=time.monotonic)


class Workers:
    """Start ``count`` children running ``argv`` (+ ``--fd``) and keep them running until
    ``stopping()`` says so; then stop them and return 0 (or 1 if a child would not start)."""

    def __init__(self, count: int, sock: socket.socket, argv: list[str], env: dict[str, str]) -> None:
        self.count = count
        self.sock = sock
        self.argv = argv
        self.env = dict(env)
        self._metrics_dir: str | None = None
        if not self.env.get("PROMETHEUS_MULTIPROC_DIR"):
            self._metrics_dir = tempfile.mkdtemp(prefix="run-engine-metrics-")
            self.env["PROMETHEUS_MULTIPROC_DIR"] = self._metrics_dir

    def _spawn(self, slot: int) -> _Child:
        fd = self.sock.fileno()
        proc = subprocess.Popen([sys.executable, "-m", "run_engine.cli", *self.argv, "--fd", str(fd)],
                                pass_fds=(fd,), env={**self.env, "RUN_ENGINE_WORKER_SLOT": str(slot)})
        log.info("server process %d started (pid %d)", slot, proc.pid)
        return _Child(slot, proc)

    def run(self, stopping: Callable[[], bool], poll_s: float = 0.2) -> int:
        children = [self._spawn(slot) for slot in range(self.count)]
        backoff: dict[int, float] = {}
        due: dict[int, float] = {}  # slot → when to start it again
        try:
            while not stopping():
                time.sleep(poll_s)
                now = time.monotonic()
                for child in list(children):
                    code = child.proc.poll()
                    if code is None or stopping():
                        continue
                    children.remove(child)
                    lived = now - child.started
                    delay = 0.0 if lived >= HEALTHY_AFTER_S else min(MAX_BACKOFF_S, backoff.get(child.slot, 0.5) * 2)
                    backoff[child.slot] = delay or 0.5
                    due[child.slot] = now + delay
                    log.error("server process %d (pid %d) exited with %s after %.0f s; starting it again in %.1f s",
                              child.slot, child.proc.pid, code, lived, delay)
                for slot, when in list(due.items()):
                    if now >= when and not stopping():
                        del due[slot]
                        children.append(self._spawn(slot))
            return 0
        finally:
            self._stop(children)

    def _stop(self, children: list[_Child]) -> None:
        for child in children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in children:
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("server process %d did not stop in %.0f s; killing it", child.slot, STOP_TIMEOUT_S)
                child.proc.kill()
                child.proc.wait()
        self.sock.close()
        if self._metrics_dir is not None:
            shutil.rmtree(self._metrics_dir, ignore_errors=True)


def die_with_parent() -> None:
    """In a child: be sent SIGTERM when the parent dies, however it dies (a parent killed with
    SIGKILL must not leave children holding the port). Linux only; elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before the call: nobody will send it
        os.kill(os.getpid(), signal.SIGTERM)


def child_env(database_url: str, redis_url: str, secret: str) -> dict[str, str]:
    """The children's environment: the URLs the parent resolved (embedded servers included) and
    the installation secret, so that they neither start servers nor look for the secret again; not
    ``RUN_ENGINE_WORKERS`` (each child is one of the processes it asked for)."""
    env = {k: v for k, v in os.environ.items() if k != "RUN_ENGINE_WORKERS"}
    return {**env, "DATABASE_URL": database_url, "REDIS_URL": redis_url, "RUN_ENGINE_SECRET": secret}
