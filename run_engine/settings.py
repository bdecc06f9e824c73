"""Engine settings: frozen dataclasses with defaults; only entry points read the environment."""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, field, fields, replace
from typing import Any

from run_engine.errors import ConfigurationError, ValidationError
from run_engine.statuses import ExecutionStatus

MiB = 1024 * 1024
MIN_METRICS_TOKEN = 16
MAX_RETENTION_DAYS = 36500  # a hundred years


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a failed attempt is retried; the API's ``retry`` keys in seconds."""

    max_attempts: int = 3
    factor: float = 2.0
    min_timeout_s: float = 1.0
    max_timeout_s: float = 10.0
    randomize: bool = True
    oom_machine: str | None = None  # an attempt killed for its memory is retried on this machine

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValidationError("retry.max_attempts", "must be at least 1")
        if self.factor < 1:
            raise ValidationError("retry.factor", "must be at least 1")
        if self.min_timeout_s < 0 or self.max_timeout_s < self.min_timeout_s:
            raise ValidationError("retry.max_timeout", "must be >= min_timeout >= 0")

    def delay_s(self, failed_attempt: int, rng: random.Random | None = None) -> float:
        """Back-off before the attempt after ``failed_attempt`` (1-based): min·factor^(n-1), capped,
        times a random factor in [1, 2) when ``randomize`` (as Trigger.dev and p-retry do)."""
        exponent = max(0, failed_attempt - 1)
        try:  # in floats: a JSON factor is an int, and int powers grow without bound
            delay = float(self.min_timeout_s) * float(self.factor) ** exponent
        except OverflowError:  # a factor of 100 at the 156th attempt: far past any maximum
            delay = float(self.max_timeout_s)
        if self.randomize:
            delay *= 1 + (rng or random).random()
        return min(delay, self.max_timeout_s)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None, base: RetryPolicy | None = None) -> RetryPolicy:
        """Build from the API's camelCase or snake_case keys, over ``base``."""
        base = base or cls()
        if not data:
            return base
        names = {
            "max_attempts": ("max_attempts", "maxAttempts"),
            "factor": ("factor",),
            "min_timeout_s": ("min_timeout", "minTimeout", "min_timeout_s"),
            "max_timeout_s": ("max_timeout", "maxTimeout", "max_timeout_s"),
            "randomize": ("randomize",),
        }
        changes: dict[str, Any] = {}
        for attr, keys in names.items():
            for key in keys:
                if key in data and data[key] is not None:
                    changes[attr] = data[key]
        oom = data.get("out_of_memory", data.get("outOfMemory"))
        if isinstance(oom, dict) and oom.get("machine"):
            changes["oom_machine"] = str(oom["machine"])
        # a minimum above the inherited maximum raises the maximum (a trigger's 20 s minimum over
        # the default 10 s maximum must not make every later attempt fail to compute its policy)
        if "max_timeout_s" not in changes and changes.get("min_timeout_s", 0) > base.max_timeout_s:
            changes["max_timeout_s"] = changes["min_timeout_s"]
        # and a maximum below the inherited minimum lowers the minimum (a trigger's 0.5 s maximum
        # under the default 1 s minimum made every computation of the run's policy fail)
        if "min_timeout_s" not in changes and "max_timeout_s" in changes \
                and 0 <= changes["max_timeout_s"] < base.min_timeout_s:
            changes["min_timeout_s"] = changes["max_timeout_s"]
        return replace(base, **changes)

    def to_json(self) -> dict[str, Any]:
        return {
            "max_attempts": self.max_attempts,
            "factor": self.factor,
            "min_timeout": self.min_timeout_s,
            "max_timeout": self.max_timeout_s,
            "randomize": self.randomize,
            **({"out_of_memory": {"machine": self.oom_machine}} if self.oom_machine else {}),
        }


@dataclass(frozen=True, slots=True)
class EngineSettings:
    database_url: str = ""
    redis_url: str = ""
    # independent Redis nodes for the run locks (RedLock: a lock needs a majority of them); empty:
    # the locks live on REDIS_URL
    lock_redis_urls: tuple[str, ...] = ()
    key_prefix: str = "re"
    queue_shards: int = 1  # raise it on Redis Cluster: each shard is one hash slot
    max_deliveries: int = 12
    pending_executing_timeout_s: float = 60.0
    executing_timeout_s: float = 60.0
    executing_with_waitpoints_timeout_s: float = 60.0
    waitpoint_sweep_interval_s: float = 5.0
    batch_creation_grace_s: float = 30.0
    pending_cancel_timeout_s: float = 60.0
    stalled_retry_delay_s: float = 0.25
    max_duration_grace_s: float = 5.0
    env_concurrency: int = 100
    max_metadata_bytes: int = 256 * 1024
    max_queue_length: int | None = None  # per environment, unless the environment sets its own
    max_queues_per_env: int = 10_000  # queues an environment may have (a trigger naming one more: 422)
    max_schedules_per_env: int = 10_000  # schedules an environment may make over the API (one more: 422)
    lease_ttl_s: float = 30.0  # leader lease: held this long, renewed every lease_renew_s
    lease_renew_s: float = 15.0
    reconcile_interval_s: float = 10.0
    reconcile_grace_s: float = 30.0  # runs touched more recently are left to the ordinary path
    rearm_interval_s: float = 60.0  # how often the leader looks for engine jobs that are missing
    reconcile_budget: int = 2000  # rows each reconciler scan reads per pass, going on where it stopped
    retention_days: float = 30.0  # finished runs older than this are deleted (0: keep forever)
    # job DLQ entries (engine jobs that failed every attempt) older than this are deleted (0: kept)
    job_dlq_retention_days: float = 7.0
    retention_batch: int = 1000
    retention_interval_s: float = 300.0
    schedule_poll_s: float = 1.0  # how often each engine process looks for due cron ticks
    schedule_jitter_s: float = 1.0  # random wait after a tick before firing it (spreads the herd)
    max_ttl_s: float | None = None  # every run expires if not started within this (a run's ttl may be shorter)
    max_payload_bytes: int = 3 * MiB
    api_rate_limit: float | None = 2000.0  # requests/s per API key or worker token (None or 0: off)
    api_rate_burst: int | None = None  # requests allowed back to back (default: one second's worth)
    max_streams_per_key: int = 100  # open realtime streams per environment, per server process
    max_long_polls_per_token: int = 1000  # open long-polls per worker token, per server process
    # statement timeout of the reads whose cost a tenant's data decides (run and token lists,
    # realtime shapes, the dashboard's lists); past it 503 read_timeout (0: no bound)
    costly_read_timeout_s: float = 5.0
    # bearer token of GET /metrics (None: not served), at least 16 characters; kept out of repr()
    metrics_token: str | None = field(default=None, repr=False)
    default_retry: RetryPolicy = field(default_factory=RetryPolicy)
    db_pool_min: int = 2
    db_pool_max: int = 8
    # the garbage collector's youngest-generation threshold in a process running an engine (0: the
    # process's own, as CPython or the host application set it); run_engine/heap.py
    gc_threshold: int = 10_000
    job_concurrency: int = 20
    job_poll_interval_s: float = 0.05

    @property
    def retention_s(self) -> float | None:
        return self.retention_days * 86400 if self.retention_days > 0 else None

    @property
    def job_dlq_retention_s(self) -> float | None:
        return self.job_dlq_retention_days * 86400 if self.job_dlq_retention_days > 0 else None

    def heartbeat_timeout_s(self, status: ExecutionStatus) -> float | None:
        return {
            ExecutionStatus.PENDING_EXECUTING: self.pending_executing_timeout_s,
            ExecutionStatus.EXECUTING: self.executing_timeout_s,
            ExecutionStatus.EXECUTING_WITH_WAITPOINTS: self.executing_with_waitpoints_timeout_s,
            ExecutionStatus.PENDING_CANCEL: self.pending_cancel_timeout_s,
        }.get(status)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> EngineSettings:
        """Read ``DATABASE_URL``, ``REDIS_URL`` and ``RUN_ENGINE_*`` variables (API.md)."""
        env = os.environ if environ is None else environ
        mapping = {
            "database_url": "DATABASE_URL",
            "redis_url": "REDIS_URL",
            "key_prefix": "RUN_ENGINE_KEY_PREFIX",
            "max_deliveries": "RUN_ENGINE_MAX_DELIVERIES",
            "pending_executing_timeout_s": "RUN_ENGINE_PENDING_EXECUTING_TIMEOUT_S",
            "executing_timeout_s": "RUN_ENGINE_EXECUTING_TIMEOUT_S",
            "executing_with_waitpoints_timeout_s": "RUN_ENGINE_EXECUTING_WITH_WAITPOINTS_TIMEOUT_S",
            "pending_cancel_timeout_s": "RUN_ENGINE_PENDING_CANCEL_TIMEOUT_S",
            "env_concurrency": "RUN_ENGINE_ENV_CONCURRENCY",
            "max_payload_bytes": "RUN_ENGINE_MAX_PAYLOAD_BYTES",
            "queue_shards": "RUN_ENGINE_QUEUE_SHARDS",
            "max_ttl_s": "RUN_ENGINE_MAX_TTL_S",
            "max_queue_length": "RUN_ENGINE_MAX_QUEUE_LENGTH",
            "max_queues_per_env": "RUN_ENGINE_MAX_QUEUES_PER_ENV",
            "max_schedules_per_env": "RUN_ENGINE_MAX_SCHEDULES_PER_ENV",
            "retention_days": "RUN_ENGINE_RETENTION_DAYS",
            "job_dlq_retention_days": "RUN_ENGINE_JOB_DLQ_RETENTION_DAYS",
            "lease_ttl_s": "RUN_ENGINE_LEASE_TTL_S",
            "lease_renew_s": "RUN_ENGINE_LEASE_RENEW_S",
            "reconcile_interval_s": "RUN_ENGINE_RECONCILE_INTERVAL_S",
            "reconcile_grace_s": "RUN_ENGINE_RECONCILE_GRACE_S",
            "reconcile_budget": "RUN_ENGINE_RECONCILE_BUDGET",
            "rearm_interval_s": "RUN_ENGINE_REARM_INTERVAL_S",
            "api_rate_limit": "RUN_ENGINE_API_RATE_LIMIT",
            "api_rate_burst": "RUN_ENGINE_API_RATE_BURST",
            "max_streams_per_key": "RUN_ENGINE_MAX_STREAMS_PER_KEY",
            "max_long_polls_per_token": "RUN_ENGINE_MAX_LONG_POLLS_PER_TOKEN",
            "costly_read_timeout_s": "RUN_ENGINE_COSTLY_READ_TIMEOUT_S",
            "metrics_token": "RUN_ENGINE_METRICS_TOKEN",
            "db_pool_max": "RUN_ENGINE_DB_POOL_MAX",
            "gc_threshold": "RUN_ENGINE_GC_THRESHOLD",
        }
        types = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for attr, var in mapping.items():
            raw = env.get(var)
            if raw is None or raw == "":
                continue
            kind = str(types[attr]).removeprefix("<class '")  # "int", "float", "float | None", …
            try:
                values[attr] = int(raw) if kind.startswith("int") else float(raw) if kind.startswith("float") else raw
            except ValueError as exc:
                raise ConfigurationError(f"{var}={raw!r} is not a number") from exc
            if isinstance(values[attr], float) and not math.isfinite(values[attr]):
                raise ConfigurationError(f"{var}={raw!r} is not a finite number")
        if values.get("max_queues_per_env", 1) < 1:
            raise ConfigurationError("RUN_ENGINE_MAX_QUEUES_PER_ENV: at least 1")
        if values.get("max_schedules_per_env", 1) < 1:
            raise ConfigurationError("RUN_ENGINE_MAX_SCHEDULES_PER_ENV: at least 1")
        if values.get("gc_threshold", 0) < 0:
            raise ConfigurationError("RUN_ENGINE_GC_THRESHOLD: at least 0 (0: the collector as it is)")
        if values.get("costly_read_timeout_s", 0) < 0:
            raise ConfigurationError("RUN_ENGINE_COSTLY_READ_TIMEOUT_S: at least 0 (0: no bound)")
        if values.get("retention_days", 0) > MAX_RETENTION_DAYS:  # (PostgreSQL's dates end before)
            raise ConfigurationError(f"RUN_ENGINE_RETENTION_DAYS: at most {MAX_RETENTION_DAYS} (0: keep forever)")
        if values.get("job_dlq_retention_days", 0) > MAX_RETENTION_DAYS:
            raise ConfigurationError(f"RUN_ENGINE_JOB_DLQ_RETENTION_DAYS: at most {MAX_RETENTION_DAYS} "
                                     "(0: keep forever)")
        if raw_locks := env.get("RUN_ENGINE_LOCK_REDIS_URLS", "").strip():
            values["lock_redis_urls"] = lock_nodes(raw_locks)
        values.update(overrides)
        token = values.get("metrics_token")
        if token is not None and len(token) < MIN_METRICS_TOKEN:
            raise ConfigurationError(f"RUN_ENGINE_METRICS_TOKEN must be at least {MIN_METRICS_TOKEN} characters "
                                     "(it guards every environment's numbers): use a long random value")
        return cls(**values)


def lock_nodes(raw: str) -> tuple[str, ...]:
    """``RUN_ENGINE_LOCK_REDIS_URLS``: comma-separated ``redis://`` URLs of independent nodes, an odd
    number (a majority of an even number tolerates no more failures than one node fewer)."""
    urls = tuple(u.strip() for u in raw.split(",") if u.strip())
    for url in urls:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigurationError(f"RUN_ENGINE_LOCK_REDIS_URLS: {url!r} is not a redis:// URL")
    if len(set(urls)) != len(urls):
        raise ConfigurationError("RUN_ENGINE_LOCK_REDIS_URLS: a node is listed twice")
    if len(urls) % 2 == 0:
        raise ConfigurationError(f"RUN_ENGINE_LOCK_REDIS_URLS: {len(urls)} nodes; use an odd number (3 or 5): a "
                                 "lock needs a majority, and an even count survives no more failures than one less")
    return urls
