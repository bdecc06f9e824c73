"""A supervisor's Prometheus metrics, served on ``--metrics-port`` (off by default; on 127.0.0.1
unless ``--metrics-host`` says otherwise). Read from the supervisor's own counters at scrape time:
nothing is done per run beyond an integer increment."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from aiohttp import web

    from supervisor.supervisor import Supervisor

log = logging.getLogger("run_engine.supervisor")


class SupervisorCollector:
    """The metrics of one supervisor, as a prometheus_client collector."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def collect(self) -> Iterable[Metric]:
        sup, pool = self.supervisor, self.supervisor.pool
        executors = GaugeMetricFamily("run_engine_supervisor_executors", "Warm executor processes: running a run "
                                      "(busy) or waiting for one (idle).", labels=["state"])
        executors.add_metric(["busy"], pool.busy)
        executors.add_metric(["idle"], pool.idle)
        yield executors
        yield GaugeMetricFamily("run_engine_supervisor_concurrency", "Runs this supervisor takes at once.",
                                value=sup.config.concurrency)
        yield CounterMetricFamily("run_engine_supervisor_runs_started", "Runs whose attempt this supervisor "
                                  "started and handed to an executor.", value=sup.runs_started)
        yield CounterMetricFamily("run_engine_supervisor_runs_completed", "Attempts whose result this supervisor "
                                  "reported to the engine.", value=sup.completed)
        yield GaugeMetricFamily("run_engine_supervisor_completions_pending", "Finished attempts whose result the "
                                "engine has not taken yet (unreachable, 429, 5xx): held and retried until it does, "
                                "their runs' heartbeats going on.", value=sup.completions_pending)
        yield CounterMetricFamily("run_engine_supervisor_suspends", "Runs checkpointed and suspended while they "
                                  "waited, their executor and slot released.", value=sup.suspended)
        yield CounterMetricFamily("run_engine_supervisor_executor_restarts", "Executor processes that died or "
                                  "were killed (crash, max duration, memory, cancel) and so replaced.",
                                  value=pool.restarts)


class MetricsServer:
    """``GET /metrics`` on its own port, on the supervisor's event loop."""

    def __init__(self, supervisor: Supervisor, host: str, port: int) -> None:
        self.collector = SupervisorCollector(supervisor)
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def _metrics(self, request: web.Request) -> web.Response:
        from aiohttp import web

        return web.Response(body=generate_latest(self.collector), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self) -> None:
        from aiohttp import web  # only when metrics are on

        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
