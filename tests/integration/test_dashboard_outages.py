"""A dependency refusing writes for a while (a PostgreSQL primary demoted by a failover, a Redis
replica, a Redis at maxmemory or unable to save) is an outage to a dashboard page as to the API:
the error page, 503, not the API's JSON answer or a 500 with its traceback."""

from __future__ import annotations

import psycopg
import pytest
from redis import exceptions as redis_errors
from redis._parsers.base import BaseParser

from run_engine.api.context import ApiContext

from .conftest import Harness, api_client
from .test_dashboard_forms import sign_in


@pytest.mark.parametrize("refusal", [
    psycopg.errors.ReadOnlySqlTransaction("cannot execute UPDATE in a read-only transaction"),
    BaseParser.parse_error("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist"),
])
async def test_a_refusal_is_the_dashboards_error_page(h: Harness, monkeypatch: pytest.MonkeyPatch,
                                                      refusal: Exception) -> None:
    async with api_client(h) as c:
        await sign_in(c, h.env.api_key)

        async def refuses(self: ApiContext, bucket: str) -> None:
            raise refusal

        monkeypatch.setattr(ApiContext, "check_limit", refuses)
        page = await c.get("/dashboard/runs")
        assert page.status_code == 503, page.text
        assert page.headers["content-type"].startswith("text/html") and page.headers["retry-after"]


async def test_an_error_of_the_engines_own_is_still_not_an_outage(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Redis error that is no refusal (WRONGTYPE: the engine's own bug) goes on to the server's
    500 and its traceback, as in the API (the in-process client raises what the app raised)."""
    async with api_client(h) as c:
        await sign_in(c, h.env.api_key)

        async def wrong(self: ApiContext, bucket: str) -> None:
            raise BaseParser.parse_error("WRONGTYPE Operation against a key holding the wrong kind of value")

        monkeypatch.setattr(ApiContext, "check_limit", wrong)
        with pytest.raises(redis_errors.ResponseError, match="WRONGTYPE"):
            await c.get("/dashboard/runs")
