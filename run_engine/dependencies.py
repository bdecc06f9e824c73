"""What "PostgreSQL or Redis cannot be reached" looks like as an exception, for the API's 503s
and for background loops that log an outage in one line instead of a traceback per attempt."""

from __future__ import annotations

import logging

import psycopg
from psycopg_pool import PoolClosed, PoolTimeout
from redis import exceptions as redis_errors

POSTGRES_DOWN = (psycopg.OperationalError, PoolTimeout, PoolClosed)
REDIS_DOWN = (redis_errors.ConnectionError, redis_errors.TimeoutError)
DEPENDENCY_ERRORS = (*POSTGRES_DOWN, *REDIS_DOWN)


def unavailable_dependency(exc: BaseException) -> str | None:
    """"postgres" or "redis" when ``exc`` says that one cannot be reached (or is shutting down,
    or loading), else None."""
    if isinstance(exc, POSTGRES_DOWN) and not (getattr(exc, "sqlstate", None) or "").startswith("54"):
        # (class 54, an OperationalError to psycopg, is a statement past a limit of PostgreSQL's
        # on the data it was given, a jsonb past 256 MiB...: not an outage, trying again fails again)
        return "postgres"
    if isinstance(exc, REDIS_DOWN):
        return "redis"
    return None


def log_failure(log: logging.Logger, exc: BaseException, message: str, *args: object) -> None:
    """A dependency outage as one warning line (it is expected and retried); anything else with
    its traceback."""
    dependency = unavailable_dependency(exc)
    if dependency is not None:
        log.warning(message + ": %s unreachable (%s); will retry", *args, dependency, type(exc).__name__)
    else:
        log.error(message, *args, exc_info=exc)
