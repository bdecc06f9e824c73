"""Every answer under /dashboard carries the dashboard's security headers, not only its pages:
its static files, a path it does not serve (404) and a method it does not take (405) were answered
by Starlette without them (a JSON 404 sniffed as HTML, a static file framed by another site). The
API's JSON answers carry ``X-Content-Type-Options: nosniff`` (a value a tenant wrote is never
sniffed into a page)."""

from __future__ import annotations

import httpx
import pytest

from run_engine.dashboard.core import SECURITY_HEADERS


def _has_the_dashboards(r: httpx.Response, *, static: bool = False) -> None:
    for name, value in SECURITY_HEADERS.items():
        if static and name == "Cache-Control":
            continue  # a static file may be cached
        assert r.headers.get(name) == value, (r.request.url, r.status_code, name, dict(r.headers))


@pytest.mark.parametrize("path", ["/dashboard/static/dashboard.css", "/dashboard/static/dashboard.js"])
async def test_the_dashboards_static_files_carry_its_headers(api: httpx.AsyncClient, path: str) -> None:
    r = await api.get(path)
    assert r.status_code == 200
    _has_the_dashboards(r, static=True)


async def test_the_dashboards_404_and_405_carry_its_headers(api: httpx.AsyncClient) -> None:
    for r in (await api.get("/dashboard/no-such-page"), await api.get("/dashboard/static/nope.js"),
              await api.put("/dashboard/runs"), await api.get("/dashboard/runs/run_x/cancel")):
        assert r.status_code in (404, 405), (r.request.url, r.status_code)
        _has_the_dashboards(r, static=r.request.url.path.startswith("/dashboard/static/"))


async def test_a_page_keeps_its_own_headers(api: httpx.AsyncClient) -> None:
    r = await api.get("/dashboard/login")
    assert r.status_code == 200
    _has_the_dashboards(r)
    assert len(r.headers.get_list("content-security-policy")) == 1  # not written twice


async def test_the_apis_json_answers_are_not_sniffed(api: httpx.AsyncClient) -> None:
    for r in (await api.get("/api/v1/runs/run_aaaaaaaaaaaaaaaaaaaaaaaa"), await api.get("/api/v1/nope"),
              await api.delete("/api/v1/runs"), await api.get("/api/v1/runs?limit=1"), await api.get("/healthz")):
        assert r.headers.get("x-content-type-options") == "nosniff", (r.request.url, r.status_code)
