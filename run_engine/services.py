"""Pick PostgreSQL and Redis: the ones in ``DATABASE_URL`` / ``REDIS_URL``, else embedded ones
with data under ``.run-engine/`` (DESIGN.md §10)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from run_engine.embedded import EmbeddedPostgres, EmbeddedRedis

DEFAULT_DATA_DIR = Path(".run-engine")
EMBEDDED_REDIS_PORT = 6390  # fixed, so that `server` and `supervisor` started apart find it


@dataclass(frozen=True, slots=True)
class Services:
    database_url: str
    redis_url: str
    embedded: bool
    data_dir: Path = DEFAULT_DATA_DIR


@contextlib.contextmanager
def services(data_dir: Path | None = None, environ: dict[str, str] | None = None, *,
             database: bool = True) -> Iterator[Services]:
    """Yield the URLs to use; embedded servers started here are stopped on exit. ``database``
    False: Redis only (no embedded PostgreSQL is started; ``database_url`` is what is set, or "")."""
    env = os.environ if environ is None else environ
    data_dir = data_dir or Path(env.get("RUN_ENGINE_DATA_DIR", DEFAULT_DATA_DIR))
    database_url = env.get("DATABASE_URL", "")
    redis_url = env.get("REDIS_URL", "")
    pg: EmbeddedPostgres | None = None
    rd: EmbeddedRedis | None = None
    try:
        if not database_url and database:
            pg = EmbeddedPostgres(data_dir / "pgdata")
            database_url = pg.start()
        if not redis_url:
            rd = EmbeddedRedis(data_dir / "redis", port=int(env.get("RUN_ENGINE_REDIS_PORT", EMBEDDED_REDIS_PORT)))
            redis_url = rd.start()
        yield Services(database_url, redis_url, embedded=pg is not None or rd is not None, data_dir=data_dir)
    finally:
        if rd is not None:
            rd.stop()
        if pg is not None:
            pg.stop()
