"""The dashboard in a browser against a hostile tenant: values the tenant chose (task ids, queue
names, tags, idempotency keys, payloads, outputs, metadata, errors and their stack traces, worker
instance names, token tags) are shown as text on every page and in the fragments the live pages
fetch again, and no script of theirs runs; and a page once shown is not kept in the browser
(htmx's history cache) for anyone to go back to after signing out.

Headless Chromium (Playwright) against the real server, as tests/e2e/test_dashboard_e2e.py."""

from __future__ import annotations

import re
import time
from urllib.parse import quote

from playwright.sync_api import Page, expect

from .conftest import Stack
from .test_dashboard_e2e import (  # noqa: F401 (this module's own Playwright and browser)
    EXPECT_MS,
    Shot,
    W,
    browser,
    browser_context_args,
    browser_type,
    launch_browser,
    playwright,
    shot,
    sign_in,
    wait_until,
)

#: every way a value could become script: markup, an attribute, a closing script tag, a URL
HOSTILE = ("<img src=x onerror=\"window.pwned=1;document.title='pwned'\">"
           "<script>window.pwned=1;document.title='pwned'</script></script>"
           "<svg onload=\"window.pwned=1\"></svg>\"'><a href=\"javascript:window.pwned=1\">x</a>")
TASK = "t<svg onload=window.pwned=1>"  # a task id (at most 128 characters): it names its queue too


def _untouched(page: Page) -> None:
    assert page.evaluate("window.pwned === undefined"), page.url
    assert page.title() != "pwned", page.url
    assert page.locator("main img, main svg, main script, main a[href^='javascript']").count() == 0, page.url


def test_a_tenants_values_are_text_on_every_page_and_run_nothing(page: Page, stack: Stack, shot: Shot) -> None:  # noqa: F811
    page.set_default_timeout(EXPECT_MS)
    own = stack.project("dash-hostile")
    with own.worker() as w, own.client() as c:
        r = w.post(f"{W}/connect", json={"workerInstanceName": HOSTILE[:250], "deployment": {
            "tasks": [{"id": TASK}]}})
        assert r.status_code == 200, r.text
        r = c.post(f"/api/v1/tasks/{TASK}/trigger", json={"payload": {"p": HOSTILE}, "options": {
            "tags": [HOSTILE[:128]], "idempotencyKey": HOSTILE, "metadata": {"m": HOSTILE}, "maxAttempts": 1}})
        assert r.status_code == 200, r.text
        failed = r.json()["id"]
        r = c.post("/api/v1/waitpoints/tokens", json={"tags": [HOSTILE[:128]]})
        assert r.status_code == 200, r.text

        deadline = time.monotonic() + 60
        while not (items := w.post(f"{W}/dequeue", json={"maxRuns": 1, "waitMs": 500}).json()["runs"]):
            assert time.monotonic() < deadline, "the run was never handed out"
        item = items[0]
        start = w.post(f"{W}/runs/{failed}/snapshots/{item['snapshot']['id']}/attempts/start")
        assert start.status_code == 200, start.text
        done = w.post(f"{W}/runs/{failed}/snapshots/{start.json()['snapshot']['id']}/attempts/complete", json={
            "ok": False, "error": {"type": "BUILT_IN_ERROR", "name": HOSTILE, "message": HOSTILE,
                                   "stackTrace": HOSTILE}})
        assert done.status_code == 200, done.text
        assert own.run(failed)["status"] == "FAILED"

    sign_in(page, own, own.api_key)
    for path in ("/dashboard/runs", f"/dashboard/runs/{failed}", "/dashboard/queues", "/dashboard/tokens",
                 "/dashboard/workers", f"/dashboard/runs?tag={HOSTILE[:128]}", f"/dashboard/runs?queue=task/{TASK}"):
        page.goto(f"{own.url}{path}")
        expect(page.locator("main")).to_contain_text(re.compile("onerror=|onload="))  # there, as text
        _untouched(page)
    page.goto(f"{own.url}/dashboard/runs/{failed}")
    for box in ("section.error-box", "div.attempt", "section.card.two"):
        expect(page.locator(box).first).to_contain_text("<script>window.pwned=1")
    shot(page, "hostile-run")

    # a live page fetches its fragment again when a run changes: the swapped-in table runs nothing either
    page.goto(f"{own.url}/dashboard/runs")
    with page.expect_response(lambda r: "partial=table" in r.url):
        own.trigger(TASK, {"again": HOSTILE}, tags=[HOSTILE[:128]])
    expect(page.locator("#runs-table tbody tr")).to_have_count(2)
    _untouched(page)


def test_a_page_is_not_kept_in_the_browser_for_after_sign_out(page: Page, stack: Stack, shot: Shot) -> None:  # noqa: F811
    """htmx keeps the last pages of a boosted navigation in sessionStorage (htmx-history-cache)
    and shows them again on Back without asking the server: after signing out, Back showed the run
    page, its payload and the session's CSRF token, from the browser alone (the pages answer
    Cache-Control: no-store so that nothing of them is kept)."""
    page.set_default_timeout(EXPECT_MS)
    own = stack.project("dash-history")
    run_id = own.trigger("manual", {"secret": "kept-in-the-browser"})
    sign_in(page, own, own.api_key)
    page.locator(f"a[href='/dashboard/runs/{run_id}']").click()  # a boosted navigation
    expect(page).to_have_url(re.compile(f"/dashboard/runs/{run_id}$"))
    expect(page.locator("section.card.two")).to_contain_text("kept-in-the-browser")
    page.get_by_role("link", name="Queues").click()
    expect(page).to_have_url(re.compile("/dashboard/queues$"))
    page.get_by_role("button", name="Sign out").click()
    expect(page).to_have_url(re.compile("/dashboard/login"))
    stored = page.evaluate("JSON.stringify(Object.entries(sessionStorage))")
    assert "kept-in-the-browser" not in stored and "csrf" not in stored, stored[:300]

    for back_to in ("/dashboard/queues", f"/dashboard/runs/{run_id}"):  # each asked of the server again
        page.go_back()
        expect(page).to_have_url(re.compile("/dashboard/login[?]next=" + re.escape(quote(back_to, safe=""))))
        expect(page.get_by_label("API key")).to_be_visible()
        expect(page.locator("body")).not_to_contain_text("kept-in-the-browser")
    shot(page, "back-after-sign-out")
