"""The dashboard at ``/dashboard``: server-rendered pages (Jinja2, htmx) over the engine facade,
signed in with an environment's secret API key. See the README's "Dashboard" and docs/API.md."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from run_engine.dashboard import actions, live, pages, signin


async def _home(request: Request) -> Response:
    return RedirectResponse("/dashboard/runs", 303)


def routes() -> list[BaseRoute]:
    r = "/dashboard"
    return [
        Route(r, _home, methods=["GET"]),
        Route(f"{r}/", _home, methods=["GET"]),
        Route(f"{r}/login", signin.login_form, methods=["GET"]),
        Route(f"{r}/login", signin.login, methods=["POST"]),
        Route(f"{r}/logout", signin.logout, methods=["POST"]),
        Route(f"{r}/runs", pages.runs, methods=["GET"]),
        Route(f"{r}/runs/trigger", actions.trigger, methods=["POST"]),
        Route(f"{r}/runs/{{run_id}}", pages.run_detail, methods=["GET"]),
        Route(f"{r}/runs/{{run_id}}/events", live.run_events, methods=["GET"]),
        Route(f"{r}/runs/{{run_id}}/cancel", actions.cancel, methods=["POST"]),
        Route(f"{r}/runs/{{run_id}}/replay", actions.replay, methods=["POST"]),
        Route(f"{r}/runs/{{run_id}}/reschedule", actions.reschedule, methods=["POST"]),
        Route(f"{r}/events", live.env_events, methods=["GET"]),
        Route(f"{r}/queues", pages.queues, methods=["GET"]),
        Route(f"{r}/queues/pause", actions.pause_queue, methods=["POST"]),
        Route(f"{r}/queues/concurrency", actions.queue_concurrency, methods=["POST"]),
        Route(f"{r}/dlq", pages.dlq, methods=["GET"]),
        Route(f"{r}/dlq/redrive", actions.redrive_all, methods=["POST"]),
        Route(f"{r}/dlq/{{run_id}}/redrive", actions.redrive, methods=["POST"]),
        Route(f"{r}/batches", pages.batches, methods=["GET"]),
        Route(f"{r}/tokens", pages.tokens, methods=["GET"]),
        Route(f"{r}/tokens/{{waitpoint_id}}/complete", actions.complete_token, methods=["POST"]),
        Route(f"{r}/schedules", pages.schedules, methods=["GET"]),
        Route(f"{r}/schedules/{{schedule_id}}/active", actions.schedule_active, methods=["POST"]),
        Route(f"{r}/workers", pages.workers, methods=["GET"]),
        Mount(f"{r}/static", StaticFiles(directory=Path(__file__).parent / "static"), name="dashboard-static"),
    ]
