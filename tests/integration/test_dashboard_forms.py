"""The dashboard's forms cost the shared server what the API's requests do: the sign-in form,
which anyone may post, is read only as far as a sign-in needs, and a signed-in form's large body
(a test run's payload, a token's output) is parsed and decoded off the event loop, held to the
API's bounds."""

from __future__ import annotations

import asyncio.events as asyncio_events
import re
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

import run_engine.api.http as api_http
import run_engine.dashboard.core as dash_core
from run_engine.api.inputs import MAX_CONTAINERS

from .conftest import Harness, api_client
from .test_dashboard_sessions import csrf_of, sign_in


async def test_the_sign_in_form_is_read_only_as_far_as_a_sign_in_needs(h: Harness) -> None:
    """Anyone may post the sign-in form: its body was read up to the largest signed-in form (three
    times the payload limit, 9 MiB) and parsed on the event loop, and 9 MiB of percent-escapes held
    the loop, every tenant's requests on it, for a second or two a post."""
    async with api_client(h) as c:
        form = await c.get("/dashboard/login")
        fields = {"csrf": csrf_of(form.text), "apiKey": h.env.api_key, "next": "/dashboard/queues"}
        big = await c.post("/dashboard/login", data={**fields, "pad": "€" * (512 * 1024)})
        assert big.status_code == 413, big.text
        assert "re_session" not in big.headers.get("set-cookie", "")
        # a sign-in with the longest next= a page sends (its filters' values) still signs in
        form = await c.get("/dashboard/login")
        nxt = "/dashboard/runs?" + str(httpx.QueryParams({"task": "€" * 256, "tag": "€" * 256, "queue": "€" * 256}))
        signed = await c.post("/dashboard/login", data={**fields, "csrf": csrf_of(form.text), "next": nxt})
        assert signed.status_code == 303 and signed.headers["location"].startswith("/dashboard/runs?"), signed.text
        assert "re_session=" in signed.headers.get("set-cookie", "")


async def test_a_test_runs_payload_is_held_to_the_apis_bounds_and_decoded_off_the_loop(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test run's payload (and a token's output) was parsed from the form and decoded as JSON on
    the event loop: a 3 MiB payload of a million empty lists held the loop, every tenant's requests
    on it, for about three seconds (1.1 s the form, 1.8 s the JSON) before it was refused, where
    the API counts the objects and arrays before decoding (413 past 250,000) and decodes a large
    payload in a thread."""
    parsed_on: list[bool] = []  # whether each parse of a form / decode of a payload ran on an event loop

    def watched(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            parsed_on.append(asyncio_events._get_running_loop() is not None)
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(dash_core, "parse_qs", watched(dash_core.parse_qs))
    monkeypatch.setattr(api_http, "decode_json_text", watched(api_http.decode_json_text))
    async with api_client(h) as c:
        csrf = await sign_in(c, h.env.api_key)
        parsed_on.clear()
        task = "forms-bounds"
        too_many = "[" + ",".join(["[]"] * (MAX_CONTAINERS + 1)) + "]"
        got = await c.post("/dashboard/runs/trigger", data={"csrf": csrf, "task": task, "payload": too_many})
        assert got.status_code == 413, got.text
        assert "250000" in got.text
        assert parsed_on == [False, False], parsed_on  # the form, then its payload: each in a thread
        assert await h.engine.list_runs(h.env.env_id, tasks=[task]) == []
        # a large payload within the bounds is a run, decoded off the loop as well
        parsed_on.clear()
        fine = orjson.dumps({"rows": ["€" * 100] * 4000}).decode()
        got = await c.post("/dashboard/runs/trigger", data={"csrf": csrf, "task": task, "payload": fine})
        assert got.status_code == 303, got.text
        assert parsed_on == [False, False], parsed_on
        (run,) = await h.engine.list_runs(h.env.env_id, tasks=[task])
        stored = await h.engine.get_run(run.id, h.env.env_id)
        assert stored is not None and stored.payload == {"rows": ["€" * 100] * 4000}
        # a small form stays on the loop (a thread costs more than it saves)
        parsed_on.clear()
        got = await c.post("/dashboard/runs/trigger", data={"csrf": csrf, "task": task, "payload": '{"a": 1}'})
        assert got.status_code == 303, got.text
        assert parsed_on == [True, True], parsed_on


async def test_signing_in_goes_back_to_the_page_asked_for_as_it_was_asked(h: Harness) -> None:
    """The page a signed-out browser asked for is where signing in goes, its query as it was: the
    sign-in decoded next= once more than it was encoded, so a filter holding % or & (task=50%,
    tag=a&b) came back another filter (task=50 with a stray %, tag=a and a field b)."""
    async with api_client(h) as c:
        c.headers.pop("Authorization")
        asked = "/dashboard/runs?" + str(httpx.QueryParams({"task": "50%", "tag": "a&b=c"}))
        sent = await c.get(asked)
        assert sent.status_code == 303, sent.text
        form = await c.get(sent.headers["location"])
        found = re.search(r'name="next" value="([^"]*)"', form.text)
        assert found is not None, form.text[:500]
        signed = await c.post("/dashboard/login", data={"csrf": csrf_of(form.text), "apiKey": h.env.api_key,
                                                        "next": found.group(1).replace("&amp;", "&")})
        assert signed.status_code == 303 and signed.headers["location"] == asked, signed.headers
        page = await c.get(signed.headers["location"])
        assert page.status_code == 200
        assert 'name="task" value="50%"' in page.text and 'name="tag" value="a&amp;b=c"' in page.text
