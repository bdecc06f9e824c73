"""Every client command of the CLI answers a 200 that is not the answer it reads (JSON of another
shape, an empty body, a proxy's HTML page) with one line naming the request and the start of the
body, and exit 1: it was a KeyError, a TypeError or rich's NotRenderableError, with its traceback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from run_engine.cli import app

from .test_cli_errors import FakeApi, serving

ANSWER: list[Any] = [None]  # what every request is answered with (JSON, or bytes as they are)
RUN = {"id": "run_1", "taskIdentifier": "echo", "status": "COMPLETED", "attemptCount": 1, "queue": "task/echo",
       "createdAt": "2025-01-01T00:00:00Z", "payload": None}


class _Api(FakeApi):
    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = ANSWER[0]
        if callable(body):
            body = body(self.command, self.path)
        if isinstance(body, bytes):
            self.answer(200, body, "text/html")
        else:
            self.answer(200, body)

    do_GET = do_POST = _answer


@pytest.fixture(scope="module")
def api() -> Iterator[str]:
    with serving(_Api) as url:
        yield url


# every command that reads what it is answered (a cancel, a token's completion or one run's redrive print
# only what they were asked)
READERS = [
    ["trigger", "echo"],
    ["trigger", "echo", "--json"],
    ["runs", "list"],
    ["runs", "get", "run_1"],
    ["runs", "get", "run_1", "--json"],
    ["runs", "replay", "run_1"],
    ["queues", "list"],
    ["queues", "pause", "q"],
    ["queues", "resume", "q"],
    ["dlq", "list"],
    ["dlq", "redrive", "--all"],
    ["tokens", "create"],
    ["tokens", "get", "waitpoint_1"],
    ["worker-groups", "list"],
    ["promote", "v1"],
]
SHAPES = [{}, [], "text", {"data": [1], "deployments": [1], "redriven": "3"}, b"",
          b"<html><body>Welcome</body></html>"]


def run(api: str, *args: str) -> Any:
    return CliRunner().invoke(app, [*args, "--api-url", api, "--api-key", "tr_dev_x"])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: json.dumps(s)[:30] if not isinstance(s, bytes) else repr(s))
@pytest.mark.parametrize("args", READERS, ids=" ".join)
def test_an_answer_of_another_shape_is_one_line_and_exit_1(api: str, args: list[str], shape: Any) -> None:
    ANSWER[0] = shape
    out = run(api, *args)
    assert isinstance(out.exception, SystemExit) and out.exit_code == 1, (out.exception, out.stdout, out.stderr)
    assert "not a run-engine answer" in out.stderr and "200" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) <= 3, out.stderr


def test_a_value_of_another_type_is_one_line(api: str) -> None:
    ANSWER[0] = {"data": [{**RUN, "id": {"a": 1}}]}  # a cell the table cannot print
    out = run(api, "runs", "list")
    assert isinstance(out.exception, SystemExit) and out.exit_code == 1, (out.exception, out.stderr)
    assert "not a run-engine answer from GET" in out.stderr, out.stderr


def test_a_wait_answered_with_another_shape_while_polling_is_one_line(api: str) -> None:
    ANSWER[0] = lambda method, path: {"id": "run_1"} if method == "POST" else {"id": "run_1", "state": "QUEUED"}
    out = run(api, "trigger", "echo", "--wait")
    assert isinstance(out.exception, SystemExit) and out.exit_code == 1, (out.exception, out.stderr)
    assert "not a run-engine answer from GET" in out.stderr and "/api/v3/runs/run_1" in out.stderr, out.stderr


def test_an_answer_of_the_right_shape_is_shown(api: str) -> None:
    ANSWER[0] = lambda method, path: {"id": "run_1"} if method == "POST" else RUN
    out = run(api, "trigger", "echo", "--wait")
    assert out.exit_code == 0, (out.exception, out.stderr)
    assert "COMPLETED" in out.stdout and "run_1" in out.stdout
