"""The gauges of ``/metrics`` read at scrape time from Redis and PostgreSQL: what is queued, running
and dead-lettered per environment and queue, the engine jobs' lag, the worker instances connected.
Read from the shared stores, they are the same whichever server process is scraped, and the
engine's hot path pays nothing for them.

A scrape's cost is bounded: a few short indexed queries, one aggregate over ``worker_instance``,
two pipelined Redis round trips and one more for the jobs. At most :data:`MAX_ENVIRONMENTS`
environments, :data:`MAX_QUEUES` queues (only of environments with runs queued or running, shared
out among them: each one's first queues by name before any one's next, so that one tenant's
thousands of queues leave the others' in) and :data:`MAX_WORKER_GROUPS` worker groups are read;
``run_engine_metrics_truncated`` says when more were left out."""

from __future__ import annotations

import asyncio
import re
import time
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from run_engine.engine import RunEngine
    from systems.resources import SystemResources

MAX_ENVIRONMENTS = 1000
MAX_QUEUES = 1000
MAX_WORKER_GROUPS = 1000
#: a supervisor heartbeats its instance every 30 s: heard from within this, it counts as connected
CONNECTED_WITHIN_S = 90.0

_UNSAFE = re.compile(r"[%\x00-\x1f\x7f\u2028\u2029]")


def label(value: str) -> str:
    """A tenant's name as a label value: ``%`` and control characters percent-encoded, so that no
    two names give one label and none can bend a line of the text format (prometheus_client
    escapes ``\\``, ``"`` and newlines as well)."""
    if not _UNSAFE.search(value):
        return value
    return _UNSAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m.group(0).encode()), value)


async def collect(engine: RunEngine) -> list[Metric]:
    began = time.perf_counter()
    r = engine.resources
    queues, jobs, workers = await asyncio.gather(
        _queues(r), r.jobs.stats(),
        r.repo.tenancy.connected_worker_instances(CONNECTED_WITHIN_S, MAX_WORKER_GROUPS + 1))
    envs, env_counts, names, more_queues, queue_counts = queues
    truncated = GaugeMetricFamily("run_engine_metrics_truncated", "1 when this scrape left series out: more "
                                  "environments, queues or worker groups than it reads.", labels=["what"])
    truncated.add_metric(["environments"], float(len(envs) > MAX_ENVIRONMENTS))
    truncated.add_metric(["queues"], float(more_queues))
    truncated.add_metric(["worker_groups"], float(len(workers) > MAX_WORKER_GROUPS))

    env_queued = _gauge("run_engine_env_runs_queued", "Runs waiting in the queue (ready or in back-off) per "
                        "environment.", "env_id")
    env_running = _gauge("run_engine_env_runs_running", "Runs holding a concurrency slot (dequeued or "
                         "executing) per environment.", "env_id")
    dlq = _gauge("run_engine_dlq_runs", "Runs in the environment's dead-letter queue.", "env_id")
    for env_id, (queued, running, dead) in zip(envs, env_counts, strict=False):
        env = label(env_id)
        env_queued.add_metric([env], queued)
        env_running.add_metric([env], running)
        dlq.add_metric([env], dead)
    queue_queued = _gauge("run_engine_queue_runs_queued", "Runs waiting in the queue per environment and queue "
                          "(environments with runs queued or running).", "env_id", "queue")
    queue_running = _gauge("run_engine_queue_runs_running", "Runs holding a slot per environment and queue "
                           "(environments with runs queued or running).", "env_id", "queue")
    for (env_id, name), (queued, running) in zip(names, queue_counts, strict=False):
        labels = [label(env_id), label(name)]
        queue_queued.add_metric(labels, queued)
        queue_running.add_metric(labels, running)

    scheduled, lag_s, dead_jobs = jobs
    job_lag = GaugeMetricFamily("run_engine_engine_jobs_lag_seconds", "How late the oldest due engine job "
                                "(heartbeat timeouts, delays, TTLs, waits) is: 0 when the job workers keep up.",
                                value=lag_s)
    job_count = GaugeMetricFamily("run_engine_engine_jobs_scheduled", "Engine jobs scheduled.", value=scheduled)
    job_dead = GaugeMetricFamily("run_engine_engine_jobs_dead", "Engine jobs that failed every attempt and were not "
                                 "armed again (run-engine jobs dead lists them; deleted after "
                                 "RUN_ENGINE_JOB_DLQ_RETENTION_DAYS).", value=dead_jobs)
    instances = _gauge("run_engine_worker_instances_connected", "Worker instances (supervisors) heard from in "
                       f"the last {CONNECTED_WITHIN_S:g} s, per worker group.", "worker_group_id")
    for group, count in workers[:MAX_WORKER_GROUPS]:
        instances.add_metric([label(group)], count)
    took = GaugeMetricFamily("run_engine_metrics_scrape_seconds", "How long reading these gauges took.",
                             value=time.perf_counter() - began)
    return [env_queued, env_running, dlq, queue_queued, queue_running, job_lag, job_count, job_dead, instances,
            truncated, took]


def _gauge(name: str, documentation: str, *labels: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, labels=list(labels))


async def _queues(r: SystemResources) -> tuple[list[str], list[tuple[int, int, int]], list[tuple[str, str]], bool,
                                                list[tuple[int, int]]]:
    """Environments (one more than read, to tell truncation) with their counts, then the queues of
    the active ones, shared out among them (and whether some were left out), with theirs."""
    envs = await r.repo.tenancy.environment_ids(MAX_ENVIRONMENTS + 1)
    env_counts = await r.queue.env_counts(envs[:MAX_ENVIRONMENTS])
    active = [e for e, (queued, running, _) in zip(envs, env_counts, strict=False) if queued or running]
    names, more = await r.repo.deployments.queue_names(active, MAX_QUEUES) if active else ([], False)
    queue_counts = await r.queue.queue_counts(names)
    return envs, env_counts, names, more, queue_counts
