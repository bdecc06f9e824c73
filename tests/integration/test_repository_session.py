"""The engine's connections are in UTC whatever the database's default time zone: the API writes
times as UTC (``...Z``), not with the offset of the server's zone."""

from __future__ import annotations

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from run_engine.api.serialize import iso
from run_engine.db.repository import Repository


async def test_a_database_in_another_time_zone_still_gives_utc_times(database_url: str) -> None:
    elsewhere = make_conninfo(**{**conninfo_to_dict(database_url), "options": "-c TimeZone=Asia/Kolkata"})
    repo = await Repository.open(elsewhere, min_size=1, max_size=1)
    try:
        async with repo.pool.connection() as conn:
            cur = await conn.execute("SELECT current_setting('TimeZone'), now()")
            zone, now = await cur.fetchone()  # type: ignore[misc]
        assert zone == "UTC" and now.utcoffset().total_seconds() == 0
        assert iso(now).endswith("Z")  # type: ignore[arg-type]
    finally:
        await repo.close()
