"""The CLI's calls are tried again where that does nothing twice, as the SDK's are: `trigger --wait`
rides out a 503, a lost answer or a refused connection while it polls (it exited 1 on the first,
the run going on), and gives up, saying so, only after a while or at its --timeout; the trigger
carries an idempotency key of its own, so that it too is sent again; a call without one is not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from run_engine.cli import app

from .test_cli_errors import FakeApi, serving

RUN = {"id": "run_1", "taskIdentifier": "echo", "status": "COMPLETED", "attemptCount": 1, "queue": "task/echo",
       "createdAt": "2025-01-01T00:00:00Z", "payload": None, "output": {"ok": 1}}
UNAVAILABLE = (503, {"error": {"code": "service_unavailable", "message": "Redis is unavailable; try again"}},
               {"Retry-After": "0"})
# what each method is answered, in turn (the last one again and again); "drop" closes the connection unanswered
SCRIPT: dict[str, list[Any]] = {}
SEEN: list[tuple[str, str, Any]] = []


class _Api(FakeApi):
    def _answer(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        SEEN.append((self.command, self.path, json.loads(raw) if raw else None))
        script = SCRIPT[self.command]
        step = script.pop(0) if len(script) > 1 else script[0]
        if step == "drop":
            self.close_connection = True
            return
        status, body, headers = step
        data = json.dumps(body).encode()
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", "Content-Length": str(len(data)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer


@pytest.fixture
def api() -> Iterator[str]:
    SEEN.clear()
    SCRIPT.clear()
    with serving(_Api) as url:
        yield url


def run(api: str, *args: str) -> Any:
    return CliRunner().invoke(app, [*args, "--api-url", api, "--api-key", "tr_dev_x"])


def test_a_wait_rides_out_a_503_and_a_lost_answer(api: str) -> None:
    SCRIPT["POST"] = [(200, {"id": "run_1", "isCached": False}, {})]
    SCRIPT["GET"] = [UNAVAILABLE, "drop", (502, {}, {}), (200, RUN, {})]
    out = run(api, "trigger", "echo", "--wait", "--json")
    assert out.exit_code == 0, (out.exception, out.stderr)
    assert json.loads(out.stdout)["status"] == "COMPLETED"
    assert [m for m, _, _ in SEEN] == ["POST", "GET", "GET", "GET", "GET"]


def test_a_trigger_whose_answer_was_lost_is_sent_again_with_its_own_key(api: str) -> None:
    SCRIPT["POST"] = [UNAVAILABLE, "drop", (200, {"id": "run_1", "isCached": True}, {})]
    out = run(api, "trigger", "echo", "--json")
    assert out.exit_code == 0, (out.exception, out.stderr)
    keys = {body["options"]["idempotencyKey"] for _, _, body in SEEN}
    assert len(SEEN) == 3 and len(keys) == 1 and keys.pop().startswith("cli:"), SEEN
    # kept for the call's tries only (retention keeps a run while its key holds: 30 days by default)
    assert {body["options"]["idempotencyKeyTTL"] for _, _, body in SEEN} == {"1h"}
    # the run found by the call's own key is the run it made
    assert json.loads(out.stdout) == {"id": "run_1", "isCached": False}


def test_a_trigger_with_the_callers_key_keeps_it_and_says_cached(api: str) -> None:
    SCRIPT["POST"] = ["drop", (200, {"id": "run_1", "isCached": True}, {})]
    out = run(api, "trigger", "echo", "--idempotency-key", "mine", "--json")
    assert out.exit_code == 0, (out.exception, out.stderr)
    assert [body["options"]["idempotencyKey"] for _, _, body in SEEN] == ["mine", "mine"]
    assert not any("idempotencyKeyTTL" in body["options"] for _, _, body in SEEN)
    assert json.loads(out.stdout) == {"id": "run_1", "isCached": True}


def test_a_call_without_a_key_is_not_sent_again_after_a_5xx_or_a_lost_answer(api: str) -> None:
    SCRIPT["POST"] = [UNAVAILABLE, (200, {"id": "run_2"}, {})]
    out = run(api, "runs", "replay", "run_1")
    assert out.exit_code == 1 and "503 service_unavailable" in out.stderr, (out.exception, out.stderr)
    SCRIPT["POST"] = ["drop", (200, {"id": "run_2"}, {})]
    out = run(api, "runs", "replay", "run_1")
    assert out.exit_code == 1 and "the answer was lost" in out.stderr, (out.exception, out.stderr)
    assert "Traceback" not in out.stderr
    assert len(SEEN) == 2
    SCRIPT["POST"] = [(429, {"error": {"code": "rate_limited", "message": "slow down"}}, {"Retry-After": "0"}),
                      (200, {"id": "run_2"}, {})]
    out = run(api, "runs", "replay", "run_1")  # refused before anything was done: sent again
    assert out.exit_code == 0 and "run_2" in out.stdout, (out.exception, out.stderr)


def test_a_wait_gives_up_at_its_timeout_and_says_so(api: str) -> None:
    SCRIPT["POST"] = [(200, {"id": "run_1", "isCached": False}, {})]
    SCRIPT["GET"] = [UNAVAILABLE]
    out = run(api, "trigger", "echo", "--wait", "--timeout", "1.5")
    assert out.exit_code == 1 and isinstance(out.exception, SystemExit), (out.exception, out.stderr)
    assert "503 service_unavailable" in out.stderr and "gave up after" in out.stderr, out.stderr
    assert "run_1 was triggered" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert len([m for m, _, _ in SEEN if m == "GET"]) > 1, SEEN


def test_a_retry_after_past_a_minute_gives_up_at_once(api: str) -> None:
    SCRIPT["POST"] = [(200, {"id": "run_1", "isCached": False}, {})]
    SCRIPT["GET"] = [(503, UNAVAILABLE[1], {"Retry-After": "3600"})]
    out = run(api, "trigger", "echo", "--wait")
    assert out.exit_code == 1, (out.exception, out.stderr)
    assert "the server asks to wait 3600 s" in out.stderr and "run_1 was triggered" in out.stderr, out.stderr
    assert [m for m, _, _ in SEEN] == ["POST", "GET"]
