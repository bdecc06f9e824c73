"""An older version of the e2e task module, with one task only (the rolling-deploy test)."""

from __future__ import annotations

from run_engine.sdk import task


@task(id="echo")
async def echo(payload, ctx):  # type: ignore[no-untyped-def]
    return {"payload": payload, "old": True}
