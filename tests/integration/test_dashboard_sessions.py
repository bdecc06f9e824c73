"""Dashboard sessions end at sign-out for every copy of the cookie, sessions opened before that
still work (and end the same way), and a sign-out Redis cannot record is refused, not pretended
(tests/e2e/test_dashboard_security_e2e.py drives the same over a real server, Redis cut)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import re

import httpx
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from run_engine.dashboard.session import LIFETIME_S
from run_engine.tenancy import hash_secret

from .conftest import Harness, api_client


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, html[:500]
    return found.group(1)


async def sign_in(c: httpx.AsyncClient, api_key: str) -> str:
    """Signs ``c`` in; the session's CSRF token."""
    form = await c.get("/dashboard/login")
    signed = await c.post("/dashboard/login", data={"csrf": csrf_of(form.text), "apiKey": api_key})
    assert signed.status_code == 303, signed.text
    page = await c.get("/dashboard/runs")
    assert page.status_code == 200
    return csrf_of(page.text)


async def test_a_copied_session_cookie_ends_at_sign_out(h: Harness) -> None:
    async with api_client(h) as c:
        csrf = await sign_in(c, h.env.api_key)
        copy = c.cookies["re_session"]
        out = await c.post("/dashboard/logout", data={"csrf": csrf})
        assert out.status_code == 303 and out.headers["location"] == "/dashboard/login"
    async with api_client(h) as c:
        c.cookies.set("re_session", copy, path="/dashboard")
        after = await c.get("/dashboard/runs")
    assert after.status_code == 303, f"the signed-out session still reads /dashboard/runs: {after.status_code}"


async def test_a_session_opened_before_server_side_sign_out_works_and_ends_at_sign_out(h: Harness) -> None:
    """A cookie as the code before made it (same format, no id of its own): it is still a session,
    and signing it out ends it too."""
    async with api_client(h) as c:
        app = c._transport.app  # type: ignore[attr-defined]
        key = app.state.ctx.tokens.derive("dashboard-session")
        token = "t" * 24
        body = f"{h.env.env_id}.{hash_secret(h.env.api_key)[:16]}.{int(h.clock.now()) + LIFETIME_S}.{token}"
        signature = base64.urlsafe_b64encode(hmac.new(key, body.encode(), hashlib.sha256).digest()).decode()
        old = f"{body}.{signature.rstrip('=')}"
        c.cookies.set("re_session", old, path="/dashboard")
        assert (await c.get("/dashboard/runs")).status_code == 200
        assert (await c.post("/dashboard/logout", data={"csrf": token})).status_code == 303
    async with api_client(h) as c:
        c.cookies.set("re_session", old, path="/dashboard")
        assert (await c.get("/dashboard/runs")).status_code == 303


async def redis_lost_its_data(h: Harness) -> None:
    """What a FLUSHALL or a restart without persistence does to the dashboard's keys."""
    keys = [k async for k in h.engine.redis.scan_iter(match=f"{h.engine.settings.key_prefix}:dash:*")]
    if keys:
        await h.engine.redis.delete(*keys)


async def test_a_signed_out_session_stays_out_after_redis_lost_its_marks(h: Harness) -> None:
    """The signed-out marks live in Redis: once it lost them, a copy of a signed-out cookie read
    the dashboard again for the rest of its 12 hours. Sessions opened before Redis's marks begin
    are refused now (sign in again); one opened after works, however long after its sign-in."""
    async with api_client(h) as c:
        csrf = await sign_in(c, h.env.api_key)
        copy = c.cookies["re_session"]
        assert (await c.post("/dashboard/logout", data={"csrf": csrf})).status_code == 303
    await redis_lost_its_data(h)
    h.clock.advance(60)
    async with api_client(h) as c:
        c.cookies.set("re_session", copy, path="/dashboard")
        after = await c.get("/dashboard/runs")
        assert after.status_code == 303, f"the signed-out session reads /dashboard/runs again: {after.status_code}"

        await sign_in(c, h.env.api_key)  # a new session works, a minute and an hour after it opened
        h.clock.advance(60)
        assert (await c.get("/dashboard/runs")).status_code == 200
        h.clock.advance(3600)
        assert (await c.get("/dashboard/runs")).status_code == 200


async def test_a_session_opened_on_a_redis_without_marks_yet_is_kept(h: Harness) -> None:
    """A new installation (or an upgrade to marks with a start): signing in writes their start
    before the session opens, so the session is not taken for one older than the marks."""
    await redis_lost_its_data(h)
    async with api_client(h) as c:
        await sign_in(c, h.env.api_key)
        h.clock.advance(600)
        assert (await c.get("/dashboard/runs")).status_code == 200


async def test_a_session_opened_by_a_process_whose_clock_is_behind_the_marks_start_is_kept(h: Harness) -> None:
    """The marks' start is written by whichever process found it missing, from its own clock: a
    process whose clock is behind that one's by more than the 2 s leeway opened sessions "before"
    the marks (by its clock), and each was refused at once (sign in, and the form again), until
    its own clock passed the start. A session opens at the marks' start at the earliest."""
    await redis_lost_its_data(h)
    prefix = h.engine.settings.key_prefix
    await h.engine.redis.set(f"{prefix}:dash:since", int(h.engine.now()) + 30)  # another process, 30 s ahead
    async with api_client(h) as c:
        await sign_in(c, h.env.api_key)
        assert (await c.get("/dashboard/runs")).status_code == 200
        h.clock.advance(60)
        assert (await c.get("/dashboard/runs")).status_code == 200


async def test_a_sign_out_redis_cannot_record_is_a_503_and_the_session_is_kept(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis gone between the session's check and the sign-out's mark: telling the browser it
    signed out while a copy of its cookie still works would be a lie; the page says so instead, with
    the sign-out button to try again, and the cookie stays."""
    async def unreachable(*_: object, **__: object) -> None:
        raise RedisConnectionError("connection refused")

    async with api_client(h) as c:
        csrf = await sign_in(c, h.env.api_key)
        with monkeypatch.context() as m:
            m.setattr(h.engine.redis, "set", unreachable)
            out = await c.post("/dashboard/logout", data={"csrf": csrf})
        assert out.status_code == 503 and "the session was not ended" in out.text
        assert "Sign out" in out.text and "re_session" not in out.headers.get("set-cookie", "")
        assert (await c.get("/dashboard/runs")).status_code == 200
        assert (await c.post("/dashboard/logout", data={"csrf": csrf})).status_code == 303


async def test_a_queue_or_schedule_form_without_its_action_changes_nothing(h: Harness) -> None:
    """A pause form with no action (or another) resumed the queue, and a schedule form deactivated."""
    await h.engine.pause_queue(h.env.env_id, "task/hello")
    schedule = await h.engine.systems.schedules.upsert(h.env.env_id, task="hello", cron="0 * * * *")
    try:
        async with api_client(h) as c:
            csrf = await sign_in(c, h.env.api_key)
            for data in ({}, {"action": "unpause"}, {"action": ""}):
                got = await c.post("/dashboard/queues/pause", data={"csrf": csrf, "queue": "task/hello", **data})
                assert got.status_code == 400, got.text
                got = await c.post(f"/dashboard/schedules/{schedule.id}/active", data={"csrf": csrf, **data})
                assert got.status_code == 400, got.text
            assert (await h.engine.task_queue(h.env.env_id, "task/hello")).paused  # type: ignore[union-attr]
            assert (await h.engine.resources.repo.schedules.get(schedule.id)).active  # type: ignore[union-attr]
            resumed = await c.post("/dashboard/queues/pause", data={"csrf": csrf, "queue": "task/hello",
                                                                    "action": "resume"})
            assert resumed.status_code == 303
            assert not (await h.engine.task_queue(h.env.env_id, "task/hello")).paused  # type: ignore[union-attr]
    finally:
        await h.engine.resources.repo.schedules.delete(schedule.id, h.env.env_id)
