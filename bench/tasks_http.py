"""The task `bench/http_e2e.py` runs: it does nothing, so the engine's own cost is measured."""

from run_engine.sdk import task


@task(id="noop")
async def noop(payload):
    return None


@task(id="wait-token")
async def wait_token(payload):
    from run_engine.sdk import wait

    result = await wait.for_token(payload["token"])
    return {"got": result.output}
