"""Metrics and logs without servers: the event → counter mapping, the label encoding that keeps a
hostile name from bending the text format, the state-change log (one line for a failure, none for a
success at INFO), the text and JSON formats, the access log, the supervisor's collector."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from prometheus_client import generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import Message, Receive, Scope, Send

from run_engine import metrics
from run_engine.api.access_log import AccessLog, loggable_path
from run_engine.api.metrics import authorized
from run_engine.errors import ConfigurationError
from run_engine.events import EventBus, RunEvent
from run_engine.gauges import label
from run_engine.logs import JsonFormatter, TextFormatter
from run_engine.run_log import RunLog
from run_engine.settings import EngineSettings
from run_engine.timings import TIMINGS
from supervisor.metrics import SupervisorCollector


def sample(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def bus() -> Iterator[EventBus]:
    events = EventBus()
    uninstall = metrics.EngineMetrics().install(events)
    yield events
    uninstall()


def test_events_move_the_counters_and_histograms(bus: EventBus) -> None:
    created = sample("run_engine_runs_created_total", status="QUEUED")
    completed = sample("run_engine_runs_finished_total", status="COMPLETED")
    failed = sample("run_engine_runs_finished_total", status="FAILED")
    dead = sample("run_engine_runs_finished_total", status="SYSTEM_FAILURE")
    started = sample("run_engine_trigger_to_start_seconds_count")
    retries = sample("run_engine_run_events_total", event="retry_scheduled")

    bus.emit(RunEvent("run_created", "run_1", "env_1", "snap_1", {"status": "QUEUED"}, attempt=0))
    bus.emit(RunEvent("attempt_started", "run_1", "env_1", "snap_2", {"attempt": 1, "queued_s": 0.2}, attempt=1))
    bus.emit(RunEvent("run_failed", "run_1", "env_1", "snap_3", {"final": False}, attempt=1))  # retried: not final
    bus.emit(RunEvent("retry_scheduled", "run_1", "env_1", "snap_3", {"delay_ms": 100}, attempt=1))
    bus.emit(RunEvent("attempt_started", "run_1", "env_1", "snap_4", {"attempt": 2}, attempt=2))  # no queued_s
    bus.emit(RunEvent("run_succeeded", "run_1", "env_1", "snap_5", attempt=2))
    bus.emit(RunEvent("run_failed", "run_2", "env_1", "snap_6", {"final": True, "status": "FAILED"}, attempt=1))
    bus.emit(RunEvent("run_dead_lettered", "run_3", "env_1", "snap_7", attempt=0))

    assert sample("run_engine_runs_created_total", status="QUEUED") == created + 1
    assert sample("run_engine_runs_finished_total", status="COMPLETED") == completed + 1
    assert sample("run_engine_runs_finished_total", status="FAILED") == failed + 1
    assert sample("run_engine_runs_finished_total", status="SYSTEM_FAILURE") == dead + 1
    assert sample("run_engine_trigger_to_start_seconds_count") == started + 1
    assert sample("run_engine_run_events_total", event="retry_scheduled") == retries + 1


def test_timings_reach_the_histograms_while_installed(bus: EventBus) -> None:
    dequeues = sample("run_engine_dequeue_seconds_count", outcome="empty")
    waits = sample("run_engine_lock_wait_seconds_count", lock="start_attempt")
    TIMINGS.dequeue("empty", 0.001)
    TIMINGS.lock_wait("start_attempt", 0.002)
    assert sample("run_engine_dequeue_seconds_count", outcome="empty") == dequeues + 1
    assert sample("run_engine_lock_wait_seconds_count", lock="start_attempt") == waits + 1


def test_leader_duty_timeouts_are_counted_by_duty_and_shown_at_zero_before(bus: EventBus) -> None:
    text = generate_latest(metrics.REGISTRY).decode()
    assert 'run_engine_leader_duty_timeouts_total{duty="retention"}' in text  # alertable from the start
    before = sample("run_engine_leader_duty_timeouts_total", duty="reconcile")
    TIMINGS.leader_duty_timeout("reconcile")
    assert sample("run_engine_leader_duty_timeouts_total", duty="reconcile") == before + 1


def test_uninstalled_metrics_see_nothing() -> None:
    events = EventBus()
    metrics.EngineMetrics().install(events)()
    created = sample("run_engine_runs_created_total", status="DELAYED")
    dequeues = sample("run_engine_dequeue_seconds_count", outcome="runs")
    events.emit(RunEvent("run_created", "run_1", "env_1", "snap_1", {"status": "DELAYED"}))
    TIMINGS.dequeue("runs", 0.001)
    assert sample("run_engine_runs_created_total", status="DELAYED") == created
    assert sample("run_engine_dequeue_seconds_count", outcome="runs") == dequeues


HOSTILE = ['q"} evil_metric 1\n# TYPE x counter', "a\rb", "a%0Db", "tab\there", "back\\slash", "ünïcødé",
           "line\u2028sep", "%", "%25"]


def test_hostile_queue_names_stay_one_label_each() -> None:
    """Every name is one label value of one series, distinct from every other name's, and the text
    parses back to exactly the series emitted (no injected metric, no broken line)."""
    family = GaugeMetricFamily("run_engine_queue_runs_queued", "q", labels=["env_id", "queue"])
    for i, name in enumerate(HOSTILE):
        family.add_metric(["env_1", label(name)], i)

    class One:
        def collect(self) -> list[GaugeMetricFamily]:
            return [family]

    text = generate_latest(One()).decode()
    parsed = list(text_string_to_metric_families(text))
    assert [f.name for f in parsed] == ["run_engine_queue_runs_queued"]
    got = {s.labels["queue"]: s.value for s in parsed[0].samples}
    assert len(got) == len(HOSTILE)
    assert got == {label(name): float(i) for i, name in enumerate(HOSTILE)}
    assert all(c.isprintable() for value in got for c in value)
    assert label("task/plain-name") == "task/plain-name"


def test_several_processes_sharing_a_multiproc_dir_are_summed(tmp_path: Path) -> None:
    """PROMETHEUS_MULTIPROC_DIR: what two server processes counted, one scrape of a third shows."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom")}
    count = ("from run_engine import metrics; metrics.RUNS_CREATED.labels('QUEUED').inc(2); "
             "metrics.TRIGGER_TO_START.observe(0.5)")
    for _ in range(2):
        subprocess.run([sys.executable, "-c", count], env=env, check=True, timeout=60)
    show = ("from prometheus_client import generate_latest; from run_engine import metrics; "
            "print(generate_latest(metrics.in_process_registry()).decode())")
    text = subprocess.run([sys.executable, "-c", show], env=env, check=True, timeout=60, capture_output=True,
                          text=True).stdout
    values = {(s.name, tuple(s.labels.items())): s.value for f in text_string_to_metric_families(text)
              for s in f.samples}
    assert values[("run_engine_runs_created_total", (("status", "QUEUED"),))] == 4
    assert values[("run_engine_trigger_to_start_seconds_count", ())] == 2
    assert not any(name.startswith("process_") for name, _ in values)


def test_a_short_metrics_token_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="RUN_ENGINE_METRICS_TOKEN"):
        EngineSettings.from_env({"RUN_ENGINE_METRICS_TOKEN": "short"})
    settings = EngineSettings.from_env({"RUN_ENGINE_METRICS_TOKEN": "x" * 16})
    assert settings.metrics_token == "x" * 16 and "x" * 16 not in repr(settings)


def test_the_metrics_token_is_a_bearer_compared_whole() -> None:
    token = "t" * 32
    assert authorized(f"Bearer {token}", token) and authorized(f"bearer {token}", token)
    assert not authorized(None, token) and not authorized(token, token)
    assert not authorized(f"Bearer {token[:-1]}", token) and not authorized(f"Basic {token}", token)


# --- the state-change log --------------------------------------------------------------------------

@pytest.fixture
def run_log() -> Iterator[tuple[EventBus, io.StringIO]]:
    """The run log at the default level (INFO), as JSON lines in a buffer."""
    logger = logging.getLogger("run_engine.runs")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    old_level, old_propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    events = EventBus()
    uninstall = RunLog().install(events)
    yield events, out
    uninstall()
    logger.removeHandler(handler)
    logger.setLevel(old_level)
    logger.propagate = old_propagate


def lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in out.getvalue().splitlines()]


def test_a_failed_run_is_one_json_line_with_its_ids(run_log: tuple[EventBus, io.StringIO]) -> None:
    events, out = run_log
    error = {"type": "BUILT_IN_ERROR", "message": "boom\nsecond line"}
    events.emit(RunEvent("run_failed", "run_1", "env_1", "snap_9", {"final": True, "status": "FAILED",
                                                                      "error": error}, attempt=3))
    [line] = lines(out)
    assert line["level"] == "warning" and line["logger"] == "run_engine.runs" and line["message"] == "run failed"
    assert {k: line[k] for k in ("event", "run_id", "env_id", "snapshot_id", "attempt", "status", "error_type")} == {
        "event": "run_failed", "run_id": "run_1", "env_id": "env_1", "snapshot_id": "snap_9", "attempt": 3,
        "status": "FAILED", "error_type": "BUILT_IN_ERROR"}
    assert line["error_message"] == "boom\nsecond line"


def test_the_happy_path_logs_nothing_at_info(run_log: tuple[EventBus, io.StringIO]) -> None:
    events, out = run_log
    for name in ("run_created", "run_dequeued", "attempt_started", "run_succeeded", "run_blocked"):
        events.emit(RunEvent(name, "run_1", "env_1", "snap_1", attempt=1))
    events.emit(RunEvent("run_failed", "run_1", "env_1", "snap_2", {"final": False}, attempt=1))  # with its retry
    events.emit(RunEvent("run_requeued", "run_1", "env_1", "snap_3", {"reason": "delay"}, attempt=0))
    assert out.getvalue() == ""
    assert not events._handlers.get("run_created") and not events._handlers.get("run_succeeded")  # not subscribed


def test_state_changes_that_matter_are_logged(run_log: tuple[EventBus, io.StringIO]) -> None:
    events, out = run_log
    events.emit(RunEvent("retry_scheduled", "r", "e", "s1", {"delay_ms": 200, "error": {"type": "X"}}, attempt=1))
    events.emit(RunEvent("run_dead_lettered", "r", "e", "s2", {"deliveries": 2}, attempt=0))
    events.emit(RunEvent("run_cancelled", "r", "e", "s3", {"status": "CANCELED", "final": True}, attempt=1))
    events.emit(RunEvent("run_redriven", "r", "e", "s4", attempt=0))
    events.emit(RunEvent("run_requeued", "r", "e", "s5", {"reason": "not started in time"}, attempt=0))
    events.emit(RunEvent("run_suspended", "r", "e", "s6", {"checkpoint": "c"}, attempt=1))
    events.emit(RunEvent("run_continued", "r", "e", "s7", attempt=1))
    events.emit(RunEvent("run_pending_version", "r", "e", "s8", {"task": "t"}, attempt=0))
    got = [(x["event"], x["level"], x["snapshot_id"]) for x in lines(out)]
    assert got == [("retry_scheduled", "info", "s1"), ("run_dead_lettered", "warning", "s2"),
                   ("run_cancelled", "info", "s3"), ("run_redriven", "info", "s4"),
                   ("run_requeued", "warning", "s5"), ("run_suspended", "info", "s6"),
                   ("run_continued", "info", "s7"), ("run_pending_version", "info", "s8")]


def test_at_debug_the_happy_path_is_logged_too() -> None:
    logger = logging.getLogger("run_engine.runs")
    old = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        events = EventBus()
        uninstall = RunLog().install(events)
        assert events._handlers.get("run_succeeded")
        uninstall()
    finally:
        logger.setLevel(old)


def record(msg: str = "run failed", **extra: Any) -> logging.LogRecord:
    rec = logging.LogRecord("run_engine.runs", logging.WARNING, __file__, 1, msg, None, None)
    rec.__dict__.update(extra)
    rec.created = datetime(2026, 1, 2, tzinfo=UTC).timestamp()
    return rec


def test_text_format_appends_the_fields_readably_on_one_line() -> None:
    text = TextFormatter().format(record(run_id="run_1", env_id="env_1", snapshot_id="snap_1", attempt=2,
                                         error_message='bad "thing"\nnext', snapshot=None))
    assert "\n" not in text
    assert text.endswith('run failed run_id=run_1 env_id=env_1 snapshot_id=snap_1 attempt=2 '
                         'error_message="bad \\"thing\\"\\nnext" snapshot=None')
    assert TextFormatter().format(record()).endswith("WARNING run_engine.runs: run failed")


def test_json_format_carries_the_fields() -> None:
    line = orjson.loads(JsonFormatter().format(record(run_id="run_1", attempt=2)))
    assert line == {"ts": "2026-01-02T00:00:00Z", "level": "warning", "logger": "run_engine.runs",
                    "message": "run failed", "run_id": "run_1", "attempt": 2}


# --- the access log --------------------------------------------------------------------------------

def answering(status: int) -> Any:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if status == 0:
            raise RuntimeError("boom")
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})
    return app


async def call(app: Any, path: bytes, query: bytes = b"") -> None:
    scope = {"type": "http", "method": "GET", "path": path.decode(), "raw_path": path, "query_string": query,
             "headers": [(b"authorization", b"Bearer tr_dev_secret")], "client": ("10.0.0.1", 5555)}

    async def receive() -> Message:
        return {"type": "http.request", "body": b""}

    async def send(message: Message) -> None:
        return None

    await app(scope, receive, send)


async def test_access_log_a_4xx_at_info_a_5xx_at_warning_and_success_only_at_debug(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="run_engine.access")
    await call(AccessLog(answering(200)), b"/api/v1/runs")
    await call(AccessLog(answering(404)), b"/api/v1/runs/run_x", b"token=secret")
    with pytest.raises(RuntimeError):
        await call(AccessLog(answering(0)), b"/api/v1/boom")
    got = [(r.levelname, r.__dict__["method"], r.__dict__["path"], r.__dict__["status"]) for r in caplog.records]
    assert got == [("INFO", "GET", "/api/v1/runs/run_x", 404), ("WARNING", "GET", "/api/v1/boom", 500)]
    for r in caplog.records:
        assert r.__dict__["duration_ms"] >= 0 and r.__dict__["client"] == "10.0.0.1"
        assert "secret" not in str(r.__dict__) and "Bearer" not in str(r.__dict__)
    caplog.clear()
    caplog.set_level(logging.DEBUG, logger="run_engine.access")
    await call(AccessLog(answering(200)), b"/api/v1/runs")
    assert [(r.levelname, r.__dict__["status"]) for r in caplog.records] == [("DEBUG", 200)]


async def test_access_lines_at_info_are_capped_per_second_and_the_drops_told(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="run_engine.access")
    now = [1000.25]
    app = AccessLog(answering(429), max_lines_per_s=3, clock=lambda: now[0])
    for _ in range(10):
        await call(app, b"/api/v1/tasks/t/trigger")
    assert len(caplog.records) == 3 and app.dropped == 7
    now[0] += 1
    await call(app, b"/api/v1/tasks/t/trigger")
    assert caplog.records[-1].__dict__["dropped"] == 7 and app.dropped == 0


def test_logged_paths_hide_signatures_and_stay_printable() -> None:
    assert loggable_path({"raw_path": b"/api/v1/waitpoints/tokens/wp_1/callback/abcdef"}) == \
        "/api/v1/waitpoints/tokens/wp_1/callback/[redacted]"
    assert loggable_path({"raw_path": b"/a b\r\n\x1b[31m\xff"}) == "/a%20b%0D%0A%1B[31m%FF"
    assert len(loggable_path({"raw_path": b"/" + b"x" * 5000})) == 512


# --- the supervisor's collector -----------------------------------------------------------------------

def test_supervisor_metrics_read_its_counters() -> None:
    sup = SimpleNamespace(pool=SimpleNamespace(busy=2, idle=1, restarts=3), config=SimpleNamespace(concurrency=4),
                          runs_started=10, completed=9, suspended=1, completions_pending=2)
    text = generate_latest(SupervisorCollector(sup)).decode()  # type: ignore[arg-type]
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(text) for s in f.samples}
    assert values == {
        ("run_engine_supervisor_executors", (("state", "busy"),)): 2,
        ("run_engine_supervisor_executors", (("state", "idle"),)): 1,
        ("run_engine_supervisor_concurrency", ()): 4,
        ("run_engine_supervisor_runs_started_total", ()): 10,
        ("run_engine_supervisor_runs_completed_total", ()): 9,
        ("run_engine_supervisor_completions_pending", ()): 2,
        ("run_engine_supervisor_suspends_total", ()): 1,
        ("run_engine_supervisor_executor_restarts_total", ()): 3,
    }
