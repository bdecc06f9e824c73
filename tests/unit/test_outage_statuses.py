"""A dependency that refuses every write for a while (a failover, a full memory, a disk it cannot
save to) is an outage to the API: 503, not 500. A supervisor takes a completion answered 500 on
every try for ``completion_refused_s`` for the engine's own error on that result and reports the
attempt failed instead (its output dropped, the task run again): a Redis failover or a Redis at
maxmemory answered 500 for that long failed runs that had succeeded."""

from __future__ import annotations

import psycopg
import pytest
from redis import exceptions as redis_errors
from redis._parsers.base import BaseParser

from run_engine.api.http import error_payload
from run_engine.dependencies import refusing_writes, unavailable_dependency


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


def test_a_redis_error_of_the_engines_own_is_still_a_500() -> None:
    assert unavailable_dependency(redis_errors.ResponseError("WRONGTYPE Operation against a key")) is None
    assert unavailable_dependency(BaseParser.parse_error("ERR user_script:1: bad argument")) is None
    assert error_payload(redis_errors.ResponseError("ERR unknown command"))[0] == 500
