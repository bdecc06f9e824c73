"""The indexed router picks the route a linear scan of every route picks, for every route of the
API and the dashboard, every method, and paths that match nothing."""

from __future__ import annotations

import re

from starlette.routing import BaseRoute, Match, Route

from run_engine import dashboard
from run_engine.api.app import routes
from run_engine.api.routing import IndexedRouter

METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def _linear(all_routes: list[BaseRoute], scope: dict[str, object]) -> tuple[BaseRoute | None, Match]:
    partial = None
    for route in all_routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return route, match
        if match is Match.PARTIAL and partial is None:
            partial = route
    return partial, Match.PARTIAL if partial is not None else Match.NONE


def _paths(route: BaseRoute) -> list[str]:
    path = getattr(route, "path", "/")
    concrete = re.sub(r"\{[^}:]+:path\}", "a/b", re.sub(r"\{[^}:]+\}", "run_x1", path))
    return [concrete, concrete + "/", concrete + "/extra", concrete.rstrip("/") + "x"]


def test_the_indexed_router_picks_what_the_linear_scan_picks() -> None:
    all_routes = [*routes(), *dashboard.routes()]
    router = IndexedRouter(all_routes)
    paths = {p for r in all_routes for p in _paths(r)} | {"/", "/nope", "/api", "/api/v1", "/api/v1/tasks",
                                                          "/engine/v1/worker-actions/dequeue/"}
    checked = 0
    for path in sorted(paths):
        for method in METHODS:
            scope = {"type": "http", "path": path, "method": method, "root_path": "", "headers": []}
            expected = _linear(all_routes, scope)
            got = _linear(router.candidates(path), scope)
            assert got == expected, (method, path)
            checked += expected[1] is not Match.NONE
    assert checked > len(all_routes)  # most routes were found by some path and method
    # the worker API's routes are tried among few others
    assert len(router.candidates("/engine/v1/worker-actions/dequeue")) < 10
    assert isinstance(router.candidates("/api/v1/tasks/t/trigger")[0], Route)
