"""The dashboard as a person uses it: headless Chromium (Playwright) against the real server and
supervisor processes. Sign in, trigger a run from the form and watch it reach COMPLETED without
reloading, read its timeline, pause and resume a queue, complete a token by hand, deactivate a
schedule, redrive a dead-lettered run, and check that another environment's key sees none of it.

Screenshots go to the test's temporary folder, and to docs/screenshots/ when
DASHBOARD_SCREENSHOTS=docs/screenshots is set (that is how the ones in docs/ were made)."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, BrowserType, Page, Playwright, expect, sync_playwright

from .conftest import ROOT, Stack

W = "/engine/v1/worker-actions"
EXPECT_MS = 30_000
expect.set_options(timeout=EXPECT_MS)  # a loaded machine: expectations poll up to this long


# pytest-playwright keeps Playwright (and the event loop its sync API runs in this thread) for the
# whole session, which breaks every later test that runs an event loop: this module's own Playwright
# and browser end with the module.
@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as pw:
        yield pw


@pytest.fixture(scope="module")
def browser_type(playwright: Playwright, browser_name: str) -> BrowserType:
    browser: BrowserType = getattr(playwright, browser_name)
    return browser


@pytest.fixture(scope="module")
def launch_browser(browser_type_launch_args: dict[str, Any], browser_type: BrowserType) -> Callable[..., Browser]:
    return lambda **kwargs: browser_type.launch(**{**browser_type_launch_args, **kwargs})


@pytest.fixture(scope="module")
def browser(launch_browser: Callable[..., Browser]) -> Iterator[Browser]:
    opened = launch_browser()
    yield opened
    opened.close()


@pytest.fixture(scope="module")
def browser_context_args() -> dict[str, Any]:
    return {}


@pytest.fixture(scope="module")
def served(stack: Stack) -> Iterator[Stack]:
    """A project of its own, served by a real supervisor."""
    own = stack.project("dashboard")
    own.start_supervisor("dash-sup", concurrency=2)

    def deployed() -> bool:
        with own.client() as c:
            return any(q["name"] == "task/echo" for q in c.get("/api/v1/queues").json()["data"])
    wait_until(deployed)
    yield own


@pytest.fixture(scope="module")
def by_hand(stack: Stack) -> Stack:
    """Another project that no supervisor serves (its runs can be dead-lettered on purpose)."""
    own = stack.project("dashboard-other")
    with own.worker() as w:
        r = w.post(f"{W}/connect", json={"workerInstanceName": "hand", "deployment": {"tasks": [{"id": "manual"}]}})
        assert r.status_code == 200, r.text
    return own


Shot = Callable[[Page, str], None]


@pytest.fixture
def shot(tmp_path: Path) -> Iterator[Shot]:
    folder = os.environ.get("DASHBOARD_SCREENSHOTS")
    targets = [tmp_path] + ([ROOT / folder] if folder else [])

    def take(page: Page, name: str) -> None:
        for target in targets:
            target.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(target / f"{name}.png"), full_page=True)
        assert (tmp_path / f"{name}.png").stat().st_size > 1000

    yield take


def sign_in(page: Page, stack: Stack, key: str) -> None:
    page.goto(f"{stack.url}/dashboard/runs")
    expect(page).to_have_url(re.compile(r"/dashboard/login\?next="))
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(re.compile(r"/dashboard/runs$"))


def wait_until(check: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_sign_in_trigger_watch_queues_tokens_schedules(page: Page, served: Stack, shot: Shot) -> None:
    page.set_default_timeout(EXPECT_MS)
    # a bad key: the form again with an error (401), no session
    page.goto(f"{served.url}/dashboard/login")
    shot(page, "login")
    page.get_by_label("API key").fill("tr_dev_not-a-key")
    with page.expect_response(lambda r: r.url.endswith("/dashboard/login") and r.request.method == "POST") as bad:
        page.get_by_role("button", name="Sign in").click()
    assert bad.value.status == 401
    expect(page.get_by_role("alert")).to_contain_text("not an environment's secret API key")

    sign_in(page, served, served.api_key)
    # trigger a test run of a deployed task from the form, and watch it finish live
    if page.locator("details.trigger").get_attribute("open") is None:  # open at first, while there are no runs
        page.get_by_text("Trigger a test run").click()
    page.get_by_label("Task to run").select_option("echo")
    page.get_by_label("Payload (JSON)").fill('{"hello": "dashboard"}')
    page.get_by_role("button", name="Trigger").click()
    expect(page).to_have_url(re.compile(r"/dashboard/runs/run_[a-z0-9]+$"))
    run_id = page.url.rsplit("/", 1)[1]
    expect(page.locator("#run-status")).to_have_text("COMPLETED", timeout=EXPECT_MS)  # no reload: the stream
    timeline = page.locator("ol.timeline")
    expect(timeline).to_contain_text("EXECUTING")
    expect(timeline).to_contain_text("FINISHED")
    expect(page.locator("section.card.two")).to_contain_text('"hello": "dashboard"')
    shot(page, "run-detail")

    # a failed run shows its attempts' errors and stack
    failed = served.trigger("always-fails", {"why": "a test"})
    served.wait_for(failed)
    page.goto(f"{served.url}/dashboard/runs/{failed}")
    expect(page.locator("#run-status")).to_have_text("FAILED")
    expect(page.get_by_role("heading", name="Attempts")).to_be_visible()
    expect(page.locator("pre.stack").first).to_contain_text("Traceback")

    # the runs list, filtered by status
    page.goto(f"{served.url}/dashboard/runs?status=COMPLETED")
    expect(page.locator("#runs-table")).to_contain_text(run_id)
    expect(page.locator("#runs-table")).not_to_contain_text(failed)
    page.goto(f"{served.url}/dashboard/runs")
    shot(page, "runs")

    # pause the echo queue: a run waits (and says why); resume: it completes
    page.get_by_role("link", name="Queues").click()
    row = page.locator("tr[data-queue='task/echo']")
    row.get_by_role("button", name="Pause").click()
    expect(page.locator("tr[data-queue='task/echo']")).to_contain_text("paused")
    waiting = served.trigger("echo", {"n": 2})
    page.goto(f"{served.url}/dashboard/runs/{waiting}")
    expect(page.locator("#run-status")).to_have_text("QUEUED")
    expect(page.locator("section.explain")).to_contain_text("paused")
    page.goto(f"{served.url}/dashboard/queues")
    shot(page, "queues")
    page.locator("tr[data-queue='task/echo']").get_by_role("button", name="Resume").click()
    expect(page.locator("tr[data-queue='task/echo']")).to_contain_text("active")
    served.wait_for(waiting)
    assert served.run(waiting)["status"] == "COMPLETED"

    # a run that waits on a token: complete the token by hand, the run finishes with its output
    token_run = served.trigger("creates-token-and-waits", {})
    token_row = page.locator("tr[data-token]").filter(has_text="WAITING").first

    def token_listed() -> bool:  # the run makes its token once it starts: look again, as a person would
        page.goto(f"{served.url}/dashboard/tokens?status=WAITING")
        return token_row.count() > 0
    wait_until(token_listed)
    shot(page, "tokens")
    token_row.get_by_label(re.compile("output of")).fill('{"approved": true}')
    token_row.get_by_role("button", name="Complete").click()
    expect(page.get_by_role("status")).to_contain_text("Completed")
    done = served.wait_for(token_run)
    assert done["status"] == "COMPLETED" and done["output"]["output"] == {"approved": True}

    # a schedule: deactivate it from its page
    with served.client() as c:
        r = c.post("/api/v1/schedules", json={"task": "echo", "cron": "0 3 * * *", "deduplicationKey": "nightly"})
        assert r.status_code == 200, r.text
        r = c.post("/api/v1/tasks/batch", json={"items": [{"task": "echo", "payload": {"i": i}} for i in range(3)]})
        assert r.status_code == 200, r.text
        batch_id = r.json()["id"]
    page.get_by_role("link", name="Schedules").click()
    expect(page.locator("table")).to_contain_text("0 3 * * *")
    page.get_by_role("button", name="Deactivate").click()
    expect(page.locator("table")).to_contain_text("inactive")
    shot(page, "schedules")

    page.get_by_role("link", name="Batches").click()
    expect(page.locator("table")).to_contain_text(batch_id)
    page.get_by_role("link", name="Workers").click()
    expect(page.locator("table").first).to_contain_text("dash-sup")
    expect(page.locator("main")).to_contain_text("echo")
    shot(page, "workers")

    # readable on a phone: nothing wider than the screen (tables scroll in their own box)
    page.set_viewport_size({"width": 390, "height": 844})
    for path in ("/dashboard/runs", f"/dashboard/runs/{failed}", "/dashboard/queues"):
        page.goto(f"{served.url}{path}")
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1"), path
    page.goto(f"{served.url}/dashboard/runs/{run_id}")
    shot(page, "run-detail-phone")


def test_dead_letter_redrive_and_another_environment_sees_nothing(page: Page, served: Stack, by_hand: Stack,
                                                                   shot: Shot) -> None:
    page.set_default_timeout(EXPECT_MS)
    mine = served.trigger("echo", {"secret": "of the first environment"})
    served.wait_for(mine)
    # a run of the hand-driven project, dequeued twice and never started: dead-lettered
    dead = by_hand.trigger("manual", {"x": 1})
    with by_hand.worker() as w:
        def dead_lettered() -> bool:
            w.post(f"{W}/dequeue", json={"maxRuns": 10, "waitMs": 500})
            return by_hand.run(dead)["status"] == "SYSTEM_FAILURE"
        wait_until(dead_lettered)

    sign_in(page, by_hand, by_hand.api_key)
    # the other environment's run is not found here, and not listed
    page.goto(f"{by_hand.url}/dashboard/runs/{mine}")
    expect(page.get_by_role("alert")).to_contain_text("run not found")
    page.goto(f"{by_hand.url}/dashboard/runs")
    expect(page.locator("#runs-table")).to_contain_text(dead)
    expect(page.locator("main")).not_to_contain_text(mine)
    page.get_by_role("link", name="Queues").click()
    expect(page.locator("main")).not_to_contain_text("task/echo")

    page.get_by_role("link", name="Dead letters").click()
    expect(page.locator("table")).to_contain_text(dead)
    shot(page, "dead-letters")
    page.once("dialog", lambda d: d.accept())  # "Redrive every dead-lettered run?"
    page.get_by_role("button", name="Redrive all").click()
    expect(page.get_by_role("status")).to_contain_text("Redrove 1 run")
    expect(page.locator("table")).to_contain_text("empty")
    assert by_hand.run(dead)["status"] == "QUEUED"

    # signing out ends the session: the pages send you to the sign-in form again
    page.get_by_role("button", name="Sign out").click()
    expect(page).to_have_url(re.compile(r"/dashboard/login"))
    page.goto(f"{by_hand.url}/dashboard/dlq")
    expect(page).to_have_url(re.compile(r"/dashboard/login\?next=%2Fdashboard%2Fdlq"))
