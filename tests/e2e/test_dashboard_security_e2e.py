"""The dashboard under hostile use, over plain HTTP against the real server: no page or action
without a session, forms only with the session's CSRF token, a session sees only its own
environment, tampered or rotated-away sessions end, no open redirect, bad input is a page with the
reason (never a 500), and the answers forbid framing and inline script."""

from __future__ import annotations

import contextlib
import json
import re

import httpx
import pytest

from .conftest import Stack

PAGES = ("/dashboard/runs", "/dashboard/queues", "/dashboard/dlq", "/dashboard/batches", "/dashboard/tokens",
         "/dashboard/schedules", "/dashboard/workers", "/dashboard/events")


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, html[:500]
    return found.group(1)


def signed_in(stack: Stack, key: str | None = None) -> tuple[httpx.Client, str]:
    """A browser-like client with a session, and the session's CSRF token."""
    c = httpx.Client(base_url=stack.url, timeout=30, follow_redirects=False)
    form = c.get("/dashboard/login")
    r = c.post("/dashboard/login", data={"csrf": csrf_of(form.text), "apiKey": key or stack.api_key,
                                         "next": "/dashboard/queues"})
    assert r.status_code == 303 and r.headers["location"] == "/dashboard/queues", r.text
    page = c.get("/dashboard/queues")
    assert page.status_code == 200
    return c, csrf_of(page.text)


@pytest.fixture(scope="module")
def alpha(stack: Stack) -> Stack:
    own = stack.project("dash-alpha")
    with own.worker() as w:
        r = w.post("/engine/v1/worker-actions/connect", json={"workerInstanceName": "hand", "deployment": {
            "tasks": [{"id": "manual"}]}})
        assert r.status_code == 200, r.text
    return own


@pytest.fixture(scope="module")
def beta(stack: Stack) -> Stack:
    return stack.project("dash-beta")


def test_nothing_without_a_session(alpha: Stack) -> None:
    run_id = alpha.trigger("manual", {"x": 1})
    with httpx.Client(base_url=alpha.url, timeout=30) as c:
        for path in (*PAGES, f"/dashboard/runs/{run_id}", f"/dashboard/runs/{run_id}/events"):
            r = c.get(path)
            assert r.status_code == 303 and r.headers["location"].startswith("/dashboard/login?next="), path
            assert run_id not in r.text
        for path in (f"/dashboard/runs/{run_id}/cancel", "/dashboard/queues/pause", "/dashboard/dlq/redrive"):
            r = c.post(path, data={"queue": "task/manual", "action": "pause"})
            assert r.status_code == 303 and r.headers["location"] == "/dashboard/login", path
        # an API key as a bearer header is not a dashboard session
        r = c.get("/dashboard/runs", headers={"Authorization": f"Bearer {alpha.api_key}"})
        assert r.status_code == 303
    assert alpha.run(run_id)["status"] == "QUEUED"


def test_sign_in_form_is_csrf_safe_and_never_redirects_away(alpha: Stack) -> None:
    with httpx.Client(base_url=alpha.url, timeout=30) as c:
        # no form token (a cross-site post): refused, no session
        r = c.post("/dashboard/login", data={"apiKey": alpha.api_key})
        assert r.status_code == 403 and "expired" in r.text and "re_session" not in r.headers.get("set-cookie", "")
        form = c.get("/dashboard/login")
        assert form.status_code == 200
        cookie = form.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
        # a worker group token is not an API key
        r = c.post("/dashboard/login", data={"csrf": csrf_of(form.text), "apiKey": alpha.token})
        assert r.status_code == 401 and "not an environment" in r.text
        for evil in ("//evil.example/x", "https://evil.example/", "/dashboardx", "/\\evil.example"):
            form = c.get("/dashboard/login")
            r = c.post("/dashboard/login", data={"csrf": csrf_of(form.text), "apiKey": alpha.api_key, "next": evil})
            assert r.status_code == 303 and r.headers["location"] == "/dashboard/runs", evil
            session = r.headers["set-cookie"]
            assert "re_session=" in session and "HttpOnly" in session and "Path=/dashboard" in session
            c.cookies.clear()


def test_forms_need_the_sessions_csrf_token(alpha: Stack) -> None:
    c, csrf = signed_in(alpha)
    with contextlib.closing(c):
        r = c.post("/dashboard/queues/pause", data={"queue": "task/manual", "action": "pause"})
        assert r.status_code == 403 and "did not come from this dashboard" in r.text
        r = c.post("/dashboard/queues/pause", data={"queue": "task/manual", "action": "pause", "csrf": "x" * 24})
        assert r.status_code == 403
        with alpha.client() as api:
            assert api.get("/api/v1/queues/task/manual").json()["paused"] is False
        # the token as an htmx header works as well as a form field
        r = c.post("/dashboard/queues/pause", data={"queue": "task/manual", "action": "pause"},
                   headers={"X-CSRF-Token": csrf})
        assert r.status_code == 303
        r = c.post("/dashboard/queues/pause", data={"queue": "task/manual", "action": "resume", "csrf": csrf})
        assert r.status_code == 303
        with alpha.client() as api:
            assert api.get("/api/v1/queues/task/manual").json()["paused"] is False


def test_a_session_sees_and_touches_only_its_environment(alpha: Stack, beta: Stack) -> None:
    theirs = alpha.trigger("manual", {"secret": "alpha's"})
    c, csrf = signed_in(beta)
    with contextlib.closing(c):
        r = c.get(f"/dashboard/runs/{theirs}")
        assert r.status_code == 404 and "alpha's" not in r.text
        for action in ("cancel", "replay"):
            r = c.post(f"/dashboard/runs/{theirs}/{action}", data={"csrf": csrf})
            assert r.status_code == 404, action
        assert c.get(f"/dashboard/runs/{theirs}/events").status_code == 404
        r = c.post("/dashboard/queues/pause", data={"queue": "task/manual", "action": "pause", "csrf": csrf})
        assert r.status_code == 404
        r = c.get("/dashboard/runs", params={"task": "manual"})
        assert r.status_code == 200 and theirs not in r.text
        r = c.post("/dashboard/runs/trigger", data={"csrf": csrf, "task": "manual", "payload": "{}"})
        assert r.status_code == 303  # a run in beta's own environment (beta has no deployment: it waits)
    assert alpha.run(theirs)["status"] == "QUEUED"
    with alpha.client() as api:
        assert api.get("/api/v1/queues/task/manual").json()["paused"] is False


def test_tampered_or_rotated_sessions_end(stack: Stack) -> None:
    own = stack.project("dash-rotates")
    c, _ = signed_in(own)
    with contextlib.closing(c):
        value = c.cookies["re_session"]
        env_id, rest = value.split(".", 1)
        c.cookies.set("re_session", f"env_aaaaaaaaaaaaaaaaaaaaaaaa.{rest}", path="/dashboard")
        assert c.get("/dashboard/runs").status_code == 303
        c.cookies.set("re_session", value, path="/dashboard")
        assert c.get("/dashboard/runs").status_code == 200
        out = own.cli("keys", "rotate", "--org", "e2e", "--project", "dash-rotates", "--env", "dev", "--json")
        assert json.loads(out.stdout)["apiKey"] != own.api_key

        def ended() -> bool:  # the server caches an environment for a few seconds
            return c.get("/dashboard/runs").status_code == 303
        from .test_dashboard_e2e import wait_until
        wait_until(ended, 30)


def test_signing_out_ends_every_copy_of_the_session(stack: Stack) -> None:
    """Sign-out only deleted the browser's cookie: the session, signed and stateless, stayed valid
    for its 12 hours, and a copy of the cookie went on reading and acting on the environment. Now
    Redis keeps the session signed out until it would have expired; other sessions go on."""
    import redis

    own = stack.project("dash-signs-out")
    run_id = own.trigger("manual", {"x": 1})
    c, csrf = signed_in(own)
    other, _ = signed_in(own)  # another browser, same key
    with contextlib.closing(c), contextlib.closing(other):
        copy = c.cookies["re_session"]
        r = c.post("/dashboard/logout", data={"csrf": csrf})
        assert r.status_code == 303 and r.headers["location"] == "/dashboard/login"
        assert 're_session=""' in r.headers["set-cookie"]
        with httpx.Client(base_url=own.url, timeout=30) as thief:
            thief.cookies.set("re_session", copy, path="/dashboard")
            for path in (*PAGES, f"/dashboard/runs/{run_id}"):
                r = thief.get(path)
                assert r.status_code == 303 and r.headers["location"].startswith("/dashboard/login?next="), path
            r = thief.post("/dashboard/queues/pause", data={"queue": "task/manual", "action": "pause", "csrf": csrf})
            assert r.status_code == 303 and r.headers["location"] == "/dashboard/login"
            r = thief.post("/dashboard/logout", data={"csrf": csrf})  # signing out again: nothing left to end
            assert r.status_code == 303 and r.headers["location"] == "/dashboard/login"
            assert thief.get("/dashboard/login").status_code == 200  # the form, not a redirect to the runs
        with own.client() as api:
            assert api.get("/api/v1/queues/task/manual").json()["paused"] is False
        assert other.get("/dashboard/runs").status_code == 200
        # the mark lives as long as the session would have (12 h), under the installation's prefix
        body = copy.rsplit(".", 1)[0]
        from run_engine.dashboard.session import LIFETIME_S, SIGNED_OUT_LEEWAY_S, Session
        env_id, prefix, expires, token = body.split(".")
        key = Session(env_id, prefix, int(expires), token).signed_out_key(stack.env["RUN_ENGINE_KEY_PREFIX"])
        with contextlib.closing(redis.Redis.from_url(stack.env["REDIS_URL"])) as r_:
            ttl = r_.ttl(key)
        assert LIFETIME_S - 120 < ttl <= LIFETIME_S + SIGNED_OUT_LEEWAY_S, (key, ttl)
        # signing in again is a new session
        again, _ = signed_in(own)
        with contextlib.closing(again):
            assert again.cookies["re_session"] != copy and again.get("/dashboard/runs").status_code == 200


def test_redis_down_the_dashboard_fails_closed_and_sign_out_waits_for_it(stack: Stack) -> None:
    """Whether a session was signed out is Redis's to say: Redis unreachable, a page or an action
    is a 503 error page that shows nothing of the environment (never the page of a session that may
    have been signed out), and signing out is refused with the cookie kept, to be tried again once
    Redis is back; the sign-in form still answers."""
    import dataclasses
    import time

    from .conftest import start_server, stop
    from .test_outage_e2e import _proxied

    own = stack.project("dash-redis-down")
    proxy, through = _proxied("REDIS_URL", stack.env["REDIS_URL"])
    log = stack.logs / "dash-redis-down.log"
    url, server = start_server(stack.env, log, REDIS_URL=through)
    here = dataclasses.replace(own, url=url)
    c, csrf = signed_in(here)
    try:
        with contextlib.closing(c):
            copy = c.cookies["re_session"]
            proxy.cut()
            deadline = time.monotonic() + 60
            while (r := c.get("/dashboard/runs")).status_code != 503:
                assert r.status_code == 200, r.text[:300]
                assert time.monotonic() < deadline, "the dashboard still answers with Redis cut"
                time.sleep(0.2)
            assert "Redis is unavailable" in r.text and r.headers["content-type"].startswith("text/html")
            assert int(r.headers["Retry-After"]) >= 1
            assert "Sign out" not in r.text and csrf not in r.text
            r = c.post("/dashboard/queues/pause", data={"queue": "task/manual", "action": "pause", "csrf": csrf})
            assert r.status_code == 503
            r = c.post("/dashboard/logout", data={"csrf": csrf})
            assert r.status_code == 503 and "Redis is unavailable" in r.text
            assert "re_session" not in r.headers.get("set-cookie", "")  # kept: sign out again later
            assert c.get("/dashboard/login").status_code == 200
            proxy.restore()
            deadline = time.monotonic() + 60
            while c.get("/dashboard/runs").status_code != 200:
                assert time.monotonic() < deadline, "the session did not work again once Redis was back"
                time.sleep(0.2)
            r = c.post("/dashboard/logout", data={"csrf": csrf})
            assert r.status_code == 303 and r.headers["location"] == "/dashboard/login"
        with httpx.Client(base_url=url, timeout=30) as thief:
            thief.cookies.set("re_session", copy, path="/dashboard")
            assert thief.get("/dashboard/runs").status_code == 303
        text = log.read_text()
        assert "Exception in ASGI application" not in text, text[-3000:]
        assert "ERROR run_engine.api" not in text and "ERROR run_engine.dashboard" not in text, text[-3000:]
    finally:
        stop(server)
        proxy.close()


def test_bad_input_is_a_page_with_the_reason(alpha: Stack) -> None:
    c, csrf = signed_in(alpha)
    with contextlib.closing(c):
        for params, reason in (({"status": "NOPE"}, "unknown status"), ({"after": "garbage"}, "not a cursor"),
                               ({"from": "yesterday"}, "not a date"), ({"task": "x" * 300}, "at most 256")):
            r = c.get("/dashboard/runs", params=params)
            assert r.status_code == 400 and reason in r.text, params
        assert c.get("/dashboard/runs/run_../../etc").status_code == 404
        assert c.get("/dashboard/runs/not-a-run").status_code == 404
        r = c.post("/dashboard/runs/trigger", data={"csrf": csrf, "task": "manual", "payload": "{nope"})
        assert r.status_code == 400 and "not valid JSON" in r.text
        r = c.post("/dashboard/runs/trigger", data={"csrf": csrf, "task": "manual", "payload": '"a\\u0000b"'})
        assert r.status_code == 400
        r = c.post("/dashboard/runs/trigger", content=b"csrf=" + csrf.encode() + b"&task=\xff\xfe",
                   headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 400 and "UTF-8" in r.text
        r = c.post("/dashboard/runs/trigger", content=b"csrf=" + csrf.encode() + b"&payload=" + b"1" * 20_000_000,
                   headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 413
        r = c.post("/dashboard/queues/concurrency", data={"csrf": csrf, "queue": "task/manual", "limit": "-3"})
        assert r.status_code == 400 and "whole number" in r.text
        r = c.post("/dashboard/runs/run_aaaaaaaaaaaaaaaaaaaaaaaa/reschedule", data={"csrf": csrf, "delay": "soon"})
        assert r.status_code == 404
        page = c.get("/dashboard/runs")
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        assert page.headers["x-frame-options"] == "DENY"
        # a hostile tag is shown as text, never as markup
        with alpha.client() as api:
            rid = api.post("/api/v1/tasks/manual/trigger", json={"payload": None, "options": {
                "tags": ["<script>alert(1)</script>"]}}).json()["id"]
        detail = c.get(f"/dashboard/runs/{rid}")
        assert "<script>alert(1)</script>" not in detail.text and "&lt;script&gt;" in detail.text


def test_the_root_sends_a_browser_to_the_dashboard(alpha: Stack) -> None:
    with httpx.Client(base_url=alpha.url, timeout=30) as c:
        r = c.get("/", headers={"Accept": "text/html,application/xhtml+xml"})
        assert r.status_code == 303 and r.headers["location"] == "/dashboard"
        assert c.get("/").json()["dashboard"] == "/dashboard"
        assert c.get("/dashboard", follow_redirects=True).url.path == "/dashboard/login"
        assert c.get("/dashboard/static/htmx-2.0.11.min.js").status_code == 200
