"""The dashboard's forms cost the shared server what the API's requests do: the sign-in form,
which anyone may post, is read only as far as a sign-in needs, and a signed-in form's large body
(a test run's payload, a token's output) is parsed and decoded off the event loop, held to the
API's bounds."""

from __future__ import annotations

import re

import httpx

from .conftest import Harness, api_client


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, html[:500]
    return found.group(1)


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
