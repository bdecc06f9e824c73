"""The API server process: engine + HTTP apps on uvicorn."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import uvicorn

from run_engine.api.app import create_app
from run_engine.api.context import ApiContext
from run_engine.engine import RunEngine
from run_engine.realtime import RealtimeHub
from run_engine.run_tokens import RunTokens
from run_engine.settings import EngineSettings
from run_engine.tenancy import installation_secret
from run_engine.wakeups import WakeUps

log = logging.getLogger(__name__)


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@contextlib.asynccontextmanager
async def api_context(settings: EngineSettings, *, secret: str | None, public_url: str) -> AsyncIterator[ApiContext]:
    engine = await RunEngine.create(settings)
    wakeups = WakeUps(engine.redis, channel=f"{settings.key_prefix}:wake")
    engine.resources.on_work(wakeups.notify)
    # a supervisor long-polling a waiting run's snapshot wakes when the run continues or is cancelled
    for name in ("run_continued", "run_cancelled"):
        engine.events.subscribe(name, lambda e: wakeups.notify(f"run:{e.run_id}"))
    await wakeups.start()
    realtime = RealtimeHub(engine.redis, prefix=settings.key_prefix)
    engine.events.subscribe("*", realtime.on_event)
    await realtime.start()
    try:
        secret = await installation_secret(engine.resources.repo, secret)
        yield ApiContext(engine=engine, tokens=RunTokens(secret), wakeups=wakeups, public_url=public_url,
                         realtime=realtime)
    finally:
        await realtime.stop()
        await wakeups.stop()
        await engine.close()


async def serve(settings: EngineSettings, *, host: str, port: int, secret: str | None,
                public_url: str | None = None) -> None:
    url = public_url or f"http://{host}:{port}"
    async with api_context(settings, secret=secret, public_url=url) as ctx:
        config = uvicorn.Config(create_app(ctx), host=host, port=port, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=1,
                                http="httptools" if _has("httptools") else "h11")
        server = uvicorn.Server(config)
        log.info("run-engine API listening on %s", url)
        await server.serve()
