"""The CLI answers a bad address, a server that is not run-engine and an unreachable database with
a message and a non-zero exit, never a traceback."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "run_engine.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env}, timeout=60)


class FakeApi(http.server.BaseHTTPRequestHandler):
    """A stand-in server for the CLI's client commands (subclasses answer with :meth:`answer`)."""

    def answer(self, status: int, data: Any, content_type: str = "application/json") -> None:
        body = data if isinstance(data, bytes) else json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """``handler`` served on a free port of 127.0.0.1 in a thread: its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _Html(FakeApi):
    def do_GET(self) -> None:  # a proxy's error page, or another program on the port
        self.answer(502, b"<html><body>502 Bad Gateway</body></html>", "text/html")


@pytest.fixture
def html_server() -> Iterator[str]:
    with serving(_Html) as url:
        yield url


def test_an_answer_that_is_not_json_is_a_message(html_server: str) -> None:
    out = cli("runs", "list", "--api-url", html_server, "--api-key", "tr_dev_x")
    assert out.returncode == 1, out
    assert "Traceback" not in out.stderr and "JSONDecodeError" not in out.stderr, out.stderr
    assert "502" in out.stderr and "not a run-engine answer" in out.stderr, out.stderr


def test_a_malformed_api_url_is_a_message() -> None:
    out = cli("runs", "list", "--api-url", "http://[::1", "--api-key", "tr_dev_x")
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr and "InvalidURL" not in out.stderr, out.stderr
    assert "http://[::1" in out.stderr, out.stderr


@pytest.mark.parametrize("url", ["postgresql://postgres@127.0.0.1:1/nope", "not a url"])
def test_migrate_with_a_database_it_cannot_reach_is_a_message(url: str) -> None:
    out = cli("migrate", DATABASE_URL=url, REDIS_URL="redis://127.0.0.1:1/0")
    assert out.returncode == 1, out
    assert "Traceback" not in out.stderr and "╭" not in out.stderr, out.stderr
    assert out.stderr.startswith("error: cannot connect to PostgreSQL"), out.stderr


def test_a_server_whose_redis_never_answers_waits_then_says_so() -> None:
    """`run-engine server` started before its Redis (docker compose) waits for it up to
    RUN_ENGINE_STARTUP_WAIT_S, then gives one line and exit 1: it was a redis ConnectionError's
    traceback at once."""
    database = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:1/nope")
    out = cli("server", "--port", "0", DATABASE_URL=database, REDIS_URL="redis://:hunter2@127.0.0.1:1/0",
              RUN_ENGINE_SECRET="s" * 32, RUN_ENGINE_STARTUP_WAIT_S="1")
    assert out.returncode == 1, out
    assert "Traceback" not in out.stderr and "╭" not in out.stderr, out.stderr
    assert "error: cannot reach" in out.stderr and "hunter2" not in out.stderr, out.stderr
