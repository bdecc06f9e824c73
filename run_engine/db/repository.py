"""The data layer's front: one connection pool, one repository per aggregate.

``repo.runs`` (runs and snapshots), ``repo.waitpoints`` (waitpoints, blocking, journal,
checkpoints, batches), ``repo.tenancy`` (orgs, projects, environments, worker groups),
``repo.deployments`` (deployments, tasks, queues), ``repo.schedules`` and ``repo.maintenance``
(lease, reconciler scans, retention). Every query is named, parameterised and maps to a dataclass.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import psycopg
from psycopg import AsyncConnection
from psycopg.conninfo import conninfo_to_dict
from psycopg.types.json import set_json_dumps, set_json_loads
from psycopg_pool import AsyncConnectionPool

from run_engine import jsontext
from run_engine.db.bulk_actions import BulkActionRepository
from run_engine.db.deployments import DeploymentRepository
from run_engine.db.maintenance import MaintenanceRepository
from run_engine.db.packets import PacketRepository
from run_engine.db.runs import RunRepository
from run_engine.db.schedules import ScheduleRepository
from run_engine.db.tenancy import TenancyRepository
from run_engine.db.waitpoints import WaitpointRepository


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def _loads(data: str | bytes) -> Any:
    return jsontext.loads(data)


set_json_dumps(_dumps)
set_json_loads(_loads)


async def _configure(conn: AsyncConnection[Any]) -> None:
    """Every connection of the pool in UTC, whatever the server's or database's default: the API
    writes times as UTC (``...Z``; a server in another zone gave ``+05:30`` offsets), and
    psycopg reads a ``timestamptz`` a little faster in the zone it knows as ``UTC``."""
    await conn.execute("SET TimeZone = 'UTC'")


#: libpq's keep-alives and TCP_USER_TIMEOUT (run_engine/redis_connect.py's DEAD_PEER_S for Redis):
#: a PostgreSQL gone without a word (its host powered off, a partition, a failover that moved the
#: address) drops the connection within about a minute instead of leaving a statement waiting for
#: the kernel's retransmissions (~15 minutes) or for ever; a statement merely slow is not cut
#: (PostgreSQL's kernel acknowledges). What the URL sets itself is kept.
DEAD_PEER_OPTIONS = {"keepalives": "1", "keepalives_idle": "30", "keepalives_interval": "10",
                     "keepalives_count": "3", "tcp_user_timeout": "30000"}


def dead_peer_options(database_url: str) -> dict[str, str]:
    """DEAD_PEER_OPTIONS but those ``database_url`` names itself."""
    try:
        own = conninfo_to_dict(database_url)
    except psycopg.ProgrammingError:  # not a URL libpq reads: the connect says why
        return {}
    old_libpq = psycopg.pq.version() < 120000  # tcp_user_timeout came with libpq 12
    return {k: v for k, v in DEAD_PEER_OPTIONS.items() if k not in own and not (old_libpq and k == "tcp_user_timeout")}


class Repository:
    """The aggregates' repositories over one psycopg connection pool."""

    def __init__(self, pool: AsyncConnectionPool) -> None:
        self.pool = pool
        self.runs = RunRepository(pool)
        self.waitpoints = WaitpointRepository(pool)
        self.tenancy = TenancyRepository(pool)
        self.deployments = DeploymentRepository(pool)
        self.schedules = ScheduleRepository(pool)
        self.maintenance = MaintenanceRepository(pool)
        self.bulk_actions = BulkActionRepository(pool)
        self.packets = PacketRepository(pool)

    @classmethod
    async def open(cls, database_url: str, *, min_size: int = 2, max_size: int = 8,
                   acquire_timeout_s: float = 10.0) -> Repository:
        """A pool of ``max_size`` connections. A caller waits at most ``acquire_timeout_s`` for
        one (PostgreSQL down: PoolTimeout, answered 503 by the API, never a hang), and a new
        connection gives up after 5 s (a host that drops packets)."""
        pool = AsyncConnectionPool(
            database_url,
            min_size=min_size,
            max_size=max_size,
            kwargs={"autocommit": True, "prepare_threshold": 0, "connect_timeout": 5,
                    **dead_peer_options(database_url)},
            configure=_configure,
            timeout=acquire_timeout_s,
            open=False,
        )
        try:
            await pool.open(wait=True, timeout=30)
        except BaseException:  # cancelled or unreachable: no pool workers left behind
            await asyncio.shield(pool.close())
            raise
        return cls(pool)

    async def close(self) -> None:
        await self.pool.close()

    async def ping(self) -> None:
        async with self.pool.connection() as conn:
            await conn.execute("SELECT 1")
