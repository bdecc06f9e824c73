"""The task `bench/http_e2e.py` runs: it does nothing, so the engine's own cost is measured."""

from run_engine.sdk import task


@task(id="noop")
async def noop(payload):
    return None
