"""A dependency that refuses every write for a while (a failover, a full memory, a disk it cannot
save to) is an outage to the API: 503, not 500. A supervisor takes a completion answered 500 on
every try for ``completion_refused_s`` for the engine's own error on that result and reports the
attempt failed instead (its output dropped, the task run again): a Redis failover or a Redis at
maxmemory answered 500 for that long failed runs that had succeeded."""

from __future__ import annotations

import logging
from typing import cast

import httpx
import psycopg
import pytest
from redis import exceptions as redis_errors
from redis._parsers.base import BaseParser

from run_engine.api.context import ApiContext
from run_engine.api.http import error_payload
from run_engine.dependencies import log_failure, refusing_writes, unavailable_dependency


@pytest.mark.parametrize("reply", [
    "READONLY You can't write against a read only replica.",
    "OOM command not allowed when used memory > 'maxmemory'.",
    "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.",
    "CLUSTERDOWN The cluster is down",
    "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
    "TRYAGAIN Multiple keys request during rehashing of slot",
])
def test_a_redis_refusing_writes_for_a_while_is_a_503(reply: str) -> None:
    exc = BaseParser.parse_error(reply)  # as redis-py raises it
    assert unavailable_dependency(exc) == "redis"
    status, data, headers = error_payload(exc)
    assert status == 503 and data["error"]["code"] == "service_unavailable" and headers


async def test_a_redis_refusing_writes_in_a_pipeline_is_a_503() -> None:
    """A pipeline rewrites the reply of the command that failed ("Command # 1 (SET k v) of pipeline
    caused error: ('MISCONF …',)"): MISCONF, which redis-py gives no class of its own, was a 500."""
    from redis.asyncio.client import Pipeline

    exc = BaseParser.parse_error("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to "
                                 "persist to disk.")
    Pipeline.annotate_exception(cast(Pipeline, None), exc, 1, ("SET", "k", "v"))
    assert "of pipeline caused error" in str(exc)
    assert unavailable_dependency(exc) == "redis" and error_payload(exc)[0] == 503
    other = BaseParser.parse_error("WRONGTYPE Operation against a key holding the wrong kind of value")
    Pipeline.annotate_exception(cast(Pipeline, None), other, 1, ("SET", "k", "v"))
    assert unavailable_dependency(other) is None


def test_postgresql_read_only_after_a_failover_is_a_503() -> None:
    exc = psycopg.errors.ReadOnlySqlTransaction("cannot execute UPDATE in a read-only transaction")
    assert refusing_writes(exc) == "postgres"
    assert error_payload(exc)[0] == 503


@pytest.mark.parametrize("exc", [psycopg.errors.DeadlockDetected("deadlock detected"),
                                 psycopg.errors.SerializationFailure("could not serialize access"),
                                 psycopg.errors.LockNotAvailable("could not obtain lock on row"),
                                 psycopg.errors.QueryCanceled("canceling statement due to statement timeout")])
def test_a_postgresql_transaction_rolled_back_for_what_ran_beside_it_is_a_503(exc: Exception) -> None:
    status, data, headers = error_payload(exc)  # (what a retry of the transaction did not get past)
    assert status == 503 and data["error"]["code"] == "service_unavailable" and headers
    assert headers["Retry-After"]


@pytest.mark.parametrize(("exc", "reason"), [
    (psycopg.errors.DeadlockDetected("deadlock detected"), "deadlock detected"),
    (psycopg.errors.SerializationFailure("could not serialize access"), "serialization failure")])
def test_a_postgresql_conflict_says_what_happened_not_unavailable(
        exc: Exception, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    status, data, _ = error_payload(exc)
    assert status == 503 and data["error"] == {  # the documented shape, with what happened
        "code": "service_unavailable", "dependency": "postgres",
        "message": f"PostgreSQL rolled the transaction back ({reason}); try again"}
    log = logging.getLogger("run_engine.test_outage_statuses")
    with caplog.at_level(logging.WARNING, logger=log.name):
        log_failure(log, exc, "engine job %s failed", "job_1")
    assert [(r.levelname, r.getMessage(), r.exc_info) for r in caplog.records] == [
        ("WARNING", f"engine job job_1 failed: postgres rolled the transaction back ({reason}); will retry", None)]


def test_a_postgresql_outage_is_still_unavailable(caplog: pytest.LogCaptureFixture) -> None:
    exc = psycopg.OperationalError("connection refused")
    assert error_payload(exc)[1]["error"]["message"] == "PostgreSQL is unavailable; try again"
    log = logging.getLogger("run_engine.test_outage_statuses")
    with caplog.at_level(logging.WARNING, logger=log.name):
        log_failure(log, exc, "claiming engine jobs failed")
    assert [r.getMessage() for r in caplog.records] == [
        "claiming engine jobs failed: postgres unreachable (OperationalError); will retry"]


def test_a_redis_error_of_the_engines_own_is_still_a_500() -> None:
    assert unavailable_dependency(redis_errors.ResponseError("WRONGTYPE Operation against a key")) is None
    assert unavailable_dependency(BaseParser.parse_error("ERR user_script:1: bad argument")) is None
    assert error_payload(redis_errors.ResponseError("ERR unknown command"))[0] == 500


class _Refusing:
    """An API context whose every credential check raises ``exc`` (where a request first reaches
    PostgreSQL or Redis)."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def env_auth(self, *args: object, **kwargs: object) -> None:
        raise self.exc


async def _answer(exc: Exception, *, raised_on: bool = True) -> httpx.Response:
    """The app's answer to a request meeting ``exc``; raises what the app raises on after answering
    (what a server logs with its traceback) unless not ``raised_on``."""
    from run_engine.api.app import create_app

    app = create_app(cast(ApiContext, _Refusing(exc)))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=raised_on)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.get("/api/v1/batches/batch_x", headers={"Authorization": "Bearer k"})


@pytest.mark.parametrize("exc", [
    psycopg.errors.ReadOnlySqlTransaction("cannot execute UPDATE in a read-only transaction"),
    *(BaseParser.parse_error(reply) for reply in (
        "READONLY You can't write against a read only replica.",
        "OOM command not allowed when used memory > 'maxmemory'.",
        "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.",
        "CLUSTERDOWN The cluster is down",
        "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
        "TRYAGAIN Multiple keys request during rehashing of slot")),
], ids=lambda exc: type(exc).__name__ + ":" + str(exc)[:10])
async def test_the_api_answers_a_refusal_as_an_outage_in_one_line(
        exc: Exception, caplog: pytest.LogCaptureFixture) -> None:
    # (answered by Starlette's ServerErrorMiddleware, it was a 503 too, but raised on after it, to
    # the server: a traceback in its log for every request during a failover; and without nosniff)
    caplog.set_level(logging.WARNING)
    answer = await _answer(exc)  # (not raised on)
    assert answer.status_code == 503 and answer.headers["Retry-After"]
    assert answer.json()["error"]["code"] == "service_unavailable"
    assert [r.levelname for r in caplog.records] == ["WARNING"] and not caplog.records[0].exc_info
    assert answer.headers["X-Content-Type-Options"] == "nosniff"  # (answered inside the middleware)


async def test_a_redis_error_of_the_engines_own_is_still_a_500_with_its_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    answer = await _answer(redis_errors.ResponseError("WRONGTYPE Operation against a key"), raised_on=False)
    assert answer.status_code == 500 and answer.json()["error"]["code"] == "internal_error"
    assert any(r.levelname == "ERROR" and r.exc_info for r in caplog.records)
