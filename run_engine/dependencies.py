"""What "PostgreSQL or Redis cannot be reached" looks like as an exception, for the API's 503s
and for background loops that log an outage in one line instead of a traceback per attempt."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import psycopg
from psycopg_pool import PoolClosed, PoolTimeout
from redis import exceptions as redis_errors

POSTGRES_DOWN = (psycopg.OperationalError, PoolTimeout, PoolClosed)
REDIS_DOWN = (redis_errors.ConnectionError, redis_errors.TimeoutError)
DEPENDENCY_ERRORS = (*POSTGRES_DOWN, *REDIS_DOWN)
# Redis reachable but refusing every write for a while, as an outage does and until it ends: a
# replica written to during a failover (READONLY), a cluster failing over or resharding
# (CLUSTERDOWN, MASTERDOWN, TRYAGAIN), maxmemory reached under noeviction (OOM), snapshots failing
# with stop-writes-on-bgsave-error (MISCONF). Like PostgreSQL's read-only transactions (25006: a
# connection still on a primary demoted by a failover; refusing_writes), they are 503s, not 500s: a supervisor
# takes a completion answered 500 for completion_refused_s for the engine's own error on that
# result and reports the attempt failed instead (its output dropped, the task run again).
REDIS_REFUSING = (redis_errors.ReadOnlyError, redis_errors.ClusterDownError, redis_errors.TryAgainError,
                  redis_errors.OutOfMemoryError)
REDIS_REFUSING_REPLIES = ("READONLY ", "CLUSTERDOWN ", "MASTERDOWN ", "TRYAGAIN ", "OOM ", "MISCONF ")
# PostgreSQL rolled the transaction back for what ran beside it, not for what it was given: a
# deadlock (40P01) or a serialization failure (40001). Psycopg raises them as OperationalError,
# so the API answers them 503 like an outage (unavailable_dependency); a transaction that is one
# idempotent unit is run again first (retry_conflicts).
TRANSACTION_CONFLICTS = {"40P01": "deadlock detected", "40001": "serialization failure"}
#: how many times retry_conflicts runs a transaction at most
CONFLICT_ATTEMPTS = 3
T = TypeVar("T")


def unavailable_dependency(exc: BaseException) -> str | None:
    """"postgres" or "redis" when ``exc`` says that one cannot be reached (or is shutting down,
    or loading), else None."""
    if isinstance(exc, POSTGRES_DOWN) and not (getattr(exc, "sqlstate", None) or "").startswith("54"):
        # (class 54, an OperationalError to psycopg, is a statement past a limit of PostgreSQL's
        # on the data it was given, a jsonb past 256 MiB...: not an outage, trying again fails again)
        return "postgres"
    if isinstance(exc, REDIS_DOWN):
        return "redis"
    if isinstance(exc, REDIS_REFUSING) or (isinstance(exc, redis_errors.ResponseError)
                                           and _reply(exc).startswith(REDIS_REFUSING_REPLIES)):
        return "redis"
    return None


def _reply(exc: redis_errors.ResponseError) -> str:
    """Redis's error reply of ``exc``: a pipeline rewrites it as "Command # 2 (SET k v) of pipeline
    caused error: ('MISCONF …',)" (the classes of the other refusals survive it, MISCONF's has none)."""
    text = str(exc)
    _, annotated, reply = text.partition(" of pipeline caused error: ")
    return reply.lstrip("('\"") if annotated else text


def transaction_conflict(exc: BaseException) -> bool:
    """Whether PostgreSQL rolled ``exc``'s transaction back for a deadlock or a serialization
    failure (running it again may well succeed)."""
    return conflict_reason(exc) is not None


def conflict_reason(exc: BaseException) -> str | None:
    """"deadlock detected" or "serialization failure" when PostgreSQL rolled ``exc``'s transaction
    back for one (what a message says instead of "unavailable": PostgreSQL answered), else None."""
    if not isinstance(exc, psycopg.Error):
        return None
    return TRANSACTION_CONFLICTS.get(getattr(exc, "sqlstate", None) or "")


async def retry_conflicts(attempt: Callable[[], Awaitable[T]], *, attempts: int = CONFLICT_ATTEMPTS,
                          log: logging.Logger | None = None, what: str = "a transaction") -> T:
    """``attempt()`` (one whole transaction, which a conflict rolls back, with nothing done outside
    it before it commits), run again after a deadlock or a serialization failure, ``attempts``
    times at most (after a short random pause, so that the two sides do not meet again in step);
    the last conflict is raised (the API's 503, with Retry-After)."""
    for n in range(1, attempts + 1):
        try:
            return await attempt()
        except psycopg.Error as exc:
            if n == attempts or not transaction_conflict(exc):
                raise
            (log or logging.getLogger("run_engine")).info("%s was rolled back (%s: %s); trying it again (%d of %d)",
                                                         what, type(exc).__name__, exc.sqlstate, n + 1, attempts)
        await asyncio.sleep(random.uniform(0.005, 0.05) * n)  # noqa: S311 (jitter)
    raise AssertionError("unreachable")


#: the exceptions that may be a dependency refusing writes (refusing_writes tells): the API answers
#: those that are with the dependency errors' handler (a 503 and one warning line), the others as
#: before (a 500 with its traceback)
MAYBE_REFUSING = (psycopg.errors.ReadOnlySqlTransaction, redis_errors.ResponseError)


def refusing_writes(exc: BaseException) -> str | None:
    """"postgres" or "redis" when ``exc`` is a dependency refusing writes for a while (an outage
    to the API's callers: 503), else None. PostgreSQL's read-only transaction is not an outage to
    the engine's own loops (a dequeue keeps its runs held rather than give them back)."""
    if (dependency := unavailable_dependency(exc)) is not None:
        return dependency
    if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
        return "postgres"
    return None


def log_failure(log: logging.Logger, exc: BaseException, message: str, *args: object) -> None:
    """A dependency outage as one warning line (it is expected and retried); anything else with
    its traceback."""
    dependency = unavailable_dependency(exc)
    if (reason := conflict_reason(exc)) is not None:
        log.warning(message + ": %s rolled the transaction back (%s); will retry", *args, dependency, reason)
    elif dependency is not None:
        log.warning(message + ": %s unreachable (%s); will retry", *args, dependency, type(exc).__name__)
    else:
        log.error(message, *args, exc_info=exc)


def redacted_url(url: str) -> str:
    """``url`` with its password hidden (for a message or a log line)."""
    return re.sub(r"://([^:/@]*):[^@/]*@", r"://\1:***@", url)


def _postgres_answers(url: str) -> str | None:
    try:
        with psycopg.connect(url, connect_timeout=3, autocommit=True) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return None


def _redis_answers(url: str) -> str | None:
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
    except ValueError as exc:  # not a Redis URL
        return str(exc)
    try:
        client.ping()
    except redis.RedisError as exc:
        if isinstance(exc, redis_errors.ResponseError) and "MOVED" in str(exc):
            return None  # (a cluster node answered)
        return str(exc) or type(exc).__name__
    finally:
        client.close()
    return None


def wait_until_reachable(database_url: str, redis_url: str, wait_s: float, *,
                         stopping: Callable[[], bool] = lambda: False, log: logging.Logger | None = None,
                         retry_s: float = 1.0) -> str | None:
    """Wait for PostgreSQL (a connection) and Redis (a PING) to answer, at most ``wait_s`` (a
    server started beside them, as docker compose does, often comes up first); None once both
    answer, else what the one that does not says (also when ``stopping`` becomes true)."""
    log = log or logging.getLogger("run_engine")
    deadline = time.monotonic() + wait_s
    logged = 0.0
    checks = (("PostgreSQL", database_url, _postgres_answers), ("Redis", redis_url, _redis_answers))
    while True:
        for name, url, answers in checks:
            problem = answers(url)
            if problem is None:
                continue
            now = time.monotonic()
            if now >= deadline or stopping():
                return f"cannot reach {name} at {redacted_url(url)}: {problem}"
            if now - logged >= 5:
                log.warning("waiting for %s at %s (%s); giving up in %.0f s", name, redacted_url(url), problem,
                            deadline - now)
                logged = now
            time.sleep(min(retry_s, max(0.0, deadline - now)))
            break
        else:
            return None
