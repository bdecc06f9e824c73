from __future__ import annotations

import random

import pytest

from run_engine.errors import ConfigurationError, ValidationError
from run_engine.settings import EngineSettings, RetryPolicy
from run_engine.statuses import ExecutionStatus


def test_retry_delay_grows_by_factor_and_is_capped() -> None:
    policy = RetryPolicy(max_attempts=10, factor=2, min_timeout_s=1, max_timeout_s=5, randomize=False)
    assert [policy.delay_s(n) for n in range(1, 6)] == [1, 2, 4, 5, 5]


def test_retry_jitter_stays_within_one_to_two_times() -> None:
    policy = RetryPolicy(min_timeout_s=1, factor=3, max_timeout_s=100, randomize=True)
    rng = random.Random(7)
    for attempt in (1, 2, 3):
        base = 3 ** (attempt - 1)
        for _ in range(50):
            assert base <= policy.delay_s(attempt, rng) < 2 * base


def test_retry_policy_from_api_keys_over_a_base() -> None:
    base = RetryPolicy(max_attempts=3)
    got = RetryPolicy.from_json({"maxAttempts": 5, "minTimeout": 0.5, "max_timeout": 9}, base)
    assert (got.max_attempts, got.min_timeout_s, got.max_timeout_s, got.factor) == (5, 0.5, 9, base.factor)
    assert RetryPolicy.from_json(None, base) is base


def test_a_bound_alone_past_the_inherited_other_moves_it() -> None:
    """A trigger's 0.5 s maximum under the default 1 s minimum made every computation of the run's
    policy fail (its start, its failure, its heartbeat timeout)."""
    assert RetryPolicy.from_json({"maxTimeout": 0.5}).min_timeout_s == 0.5
    assert RetryPolicy.from_json({"minTimeout": 20}).max_timeout_s == 20


def test_a_huge_factor_or_attempt_gives_the_maximum_delay() -> None:
    for randomize in (False, True):
        policy = RetryPolicy(max_attempts=3000, factor=100, min_timeout_s=1, max_timeout_s=60, randomize=randomize)
        assert policy.delay_s(200) == 60  # 100 ** 199 does not fit a float
        assert RetryPolicy(max_attempts=3000, randomize=randomize).delay_s(2000) == 10  # 2 ** 1999 neither


@pytest.mark.parametrize("bad", [{"max_attempts": 0}, {"factor": 0.5}, {"min_timeout_s": 5, "max_timeout_s": 1}])
def test_retry_policy_rejects_nonsense(bad: dict) -> None:
    with pytest.raises(ValidationError):
        RetryPolicy(**bad)


def test_settings_from_env_reads_documented_variables() -> None:
    s = EngineSettings.from_env({
        "DATABASE_URL": "postgresql://x/db", "REDIS_URL": "redis://y", "RUN_ENGINE_MAX_DELIVERIES": "4",
        "RUN_ENGINE_PENDING_EXECUTING_TIMEOUT_S": "1.5", "RUN_ENGINE_ENV_CONCURRENCY": "7",
        "RUN_ENGINE_DB_POOL_MAX": "12",
    })
    assert (s.database_url, s.redis_url, s.max_deliveries, s.pending_executing_timeout_s, s.env_concurrency) == (
        "postgresql://x/db", "redis://y", 4, 1.5, 7)
    assert s.db_pool_max == 12 and EngineSettings.from_env({}).db_pool_max == 8
    assert s.heartbeat_timeout_s(ExecutionStatus.PENDING_EXECUTING) == 1.5
    assert s.heartbeat_timeout_s(ExecutionStatus.QUEUED) is None


def test_settings_from_env_names_the_bad_variable() -> None:
    with pytest.raises(ConfigurationError, match="RUN_ENGINE_MAX_DELIVERIES"):
        EngineSettings.from_env({"RUN_ENGINE_MAX_DELIVERIES": "many"})


@pytest.mark.parametrize("raw", ["inf", "-inf", "nan", "40000"])
def test_a_retention_postgresql_cannot_count_is_refused_at_start(raw: str) -> None:
    """inf (or a hundred centuries) passed, and every retention pass then failed on an interval
    PostgreSQL cannot hold: nothing was ever deleted."""
    with pytest.raises(ConfigurationError, match="RUN_ENGINE_RETENTION_DAYS"):
        EngineSettings.from_env({"RUN_ENGINE_RETENTION_DAYS": raw})
    assert EngineSettings.from_env({"RUN_ENGINE_RETENTION_DAYS": "0"}).retention_s is None
    assert EngineSettings.from_env({"RUN_ENGINE_RETENTION_DAYS": "7"}).retention_s == 7 * 86400


def test_the_job_dlqs_retention_is_a_setting_of_seven_days() -> None:
    assert EngineSettings().job_dlq_retention_s == 7 * 86400
    assert EngineSettings.from_env({"RUN_ENGINE_JOB_DLQ_RETENTION_DAYS": "0"}).job_dlq_retention_s is None
    assert EngineSettings.from_env({"RUN_ENGINE_JOB_DLQ_RETENTION_DAYS": "1.5"}).job_dlq_retention_s == 1.5 * 86400
    for raw in ("inf", "40000"):
        with pytest.raises(ConfigurationError, match="RUN_ENGINE_JOB_DLQ_RETENTION_DAYS"):
            EngineSettings.from_env({"RUN_ENGINE_JOB_DLQ_RETENTION_DAYS": raw})


def test_the_queues_an_environment_may_have_are_at_least_one() -> None:
    assert EngineSettings.from_env({"RUN_ENGINE_MAX_QUEUES_PER_ENV": "50"}).max_queues_per_env == 50
    assert EngineSettings.from_env({}).max_queues_per_env == 10_000
    with pytest.raises(ConfigurationError, match="RUN_ENGINE_MAX_QUEUES_PER_ENV"):
        EngineSettings.from_env({"RUN_ENGINE_MAX_QUEUES_PER_ENV": "0"})


def test_the_schedules_an_environment_may_make_are_at_least_one() -> None:
    assert EngineSettings.from_env({"RUN_ENGINE_MAX_SCHEDULES_PER_ENV": "5"}).max_schedules_per_env == 5
    assert EngineSettings.from_env({}).max_schedules_per_env == 10_000
    with pytest.raises(ConfigurationError, match="RUN_ENGINE_MAX_SCHEDULES_PER_ENV"):
        EngineSettings.from_env({"RUN_ENGINE_MAX_SCHEDULES_PER_ENV": "0"})


def test_the_costly_read_timeout_is_a_setting() -> None:
    """The statement timeout of the reads whose cost a tenant's data decides (0: none)."""
    assert EngineSettings.from_env({}).costly_read_timeout_s == 5.0
    assert EngineSettings.from_env({"RUN_ENGINE_COSTLY_READ_TIMEOUT_S": "0.25"}).costly_read_timeout_s == 0.25
    assert EngineSettings.from_env({"RUN_ENGINE_COSTLY_READ_TIMEOUT_S": "0"}).costly_read_timeout_s == 0
    with pytest.raises(ConfigurationError, match="RUN_ENGINE_COSTLY_READ_TIMEOUT_S"):
        EngineSettings.from_env({"RUN_ENGINE_COSTLY_READ_TIMEOUT_S": "-1"})


def test_the_collectors_threshold_is_a_setting() -> None:
    assert EngineSettings().gc_threshold == 10_000
    assert EngineSettings.from_env({"RUN_ENGINE_GC_THRESHOLD": "0"}).gc_threshold == 0
    assert EngineSettings.from_env({"RUN_ENGINE_GC_THRESHOLD": "50000"}).gc_threshold == 50_000
    with pytest.raises(ConfigurationError, match="RUN_ENGINE_GC_THRESHOLD"):
        EngineSettings.from_env({"RUN_ENGINE_GC_THRESHOLD": "-1"})
    with pytest.raises(ConfigurationError, match="RUN_ENGINE_GC_THRESHOLD"):
        EngineSettings.from_env({"RUN_ENGINE_GC_THRESHOLD": "lots"})
