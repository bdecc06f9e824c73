"""Reads bounded in time: the reads whose cost a tenant's data decides (run and token lists,
realtime shapes) run in a transaction of their own with a statement timeout, so that one
pathological read cannot hold a connection of the pool every tenant shares for as long as it
likes. Past it PostgreSQL cancels the statement, the transaction is rolled back and the caller
gets :class:`~run_engine.errors.ReadTimeoutError` (the API's 503 ``read_timeout``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from psycopg import AsyncConnection
from psycopg.errors import QueryCanceled
from psycopg_pool import AsyncConnectionPool

from run_engine.errors import ReadTimeoutError


@contextlib.asynccontextmanager
async def bounded_read(pool: AsyncConnectionPool, timeout_s: float | None) -> AsyncIterator[AsyncConnection[Any]]:
    """A connection of ``pool`` on which each statement may take at most ``timeout_s`` (None or 0:
    no bound, the connection as the pool gives it)."""
    async with pool.connection() as conn:
        if not timeout_s:
            yield conn
            return
        try:
            async with conn.transaction():
                # SET LOCAL: the bound ends with the transaction, the pooled connection keeps none
                await conn.execute("SELECT set_config('statement_timeout', %s, true)",
                                   (f"{max(1, round(timeout_s * 1000))}ms",))
                yield conn
        except QueryCanceled as exc:  # (57014: a statement timeout, or an operator's pg_cancel_backend)
            raise ReadTimeoutError(timeout_s) from exc
