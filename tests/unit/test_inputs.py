"""What the server refuses before anything is written: NUL, nesting, id shapes, paths."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from run_engine.api.inputs import MAX_DEPTH, RejectUnstorable, looks_like_id, needs_scan, unstorable
from run_engine.api.models import MAX_DURATION_S, parse_duration_s, parse_when


def nested(n: int) -> Any:
    v: Any = "leaf"
    for _ in range(n):
        v = {"k": v}
    return v


@pytest.mark.parametrize(("value", "where"), [
    ({"a": [1, {"b": "x\x00"}]}, "body.a.1.b"),
    ({"a\x00": 1}, "body"),
    (["ok", "\x00"], "body.1"),
    (nested(MAX_DEPTH + 1), "body" + ".k" * MAX_DEPTH),
])
def test_unstorable_names_the_field(value: Any, where: str) -> None:
    problem = unstorable(value)
    assert problem is not None and problem.startswith(where + ":")


@pytest.mark.parametrize("value", [None, 1, "text", {"a": "\\u0000 as text"}, nested(MAX_DEPTH - 1), [[]] * 500])
def test_storable_values_pass(value: Any) -> None:
    assert unstorable(value) is None


def test_needs_scan_finds_every_value_that_unstorable_would_refuse() -> None:
    for value in ({"a": "\x00"}, {"\x00": 1}, nested(MAX_DEPTH + 1)):
        assert needs_scan(orjson.dumps(value))
    assert not needs_scan(orjson.dumps({"plain": [1, 2, {"x": "y"}]}))


def test_ids_of_the_wrong_shape_are_not_looked_up() -> None:
    assert looks_like_id("run_abc234", "run")
    for bad in ("run_", "run_" + "a" * 65, "waitpoint_abc", "run_ABC", "run_a b", "run_é", "run_a\x00", "run_a\n"):
        assert not looks_like_id(bad, "run")


def test_durations_are_bounded() -> None:
    assert parse_duration_s("3650d") == MAX_DURATION_S
    for bad in (1e20, float("inf"), -1, "3651d", "1e400"):
        with pytest.raises(ValueError):
            parse_duration_s(bad)
    with pytest.raises(ValueError):
        parse_when(1e20, 0)


async def test_middleware_refuses_nul_and_bad_utf8_in_path_and_query() -> None:
    app = Starlette(routes=[Route("/x/{v}", lambda r: PlainTextResponse(r.path_params["v"]))])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=RejectUnstorable(app)),
                                 base_url="http://t") as client:
        assert (await client.get("/x/ok?q=1")).text == "ok"
        assert (await client.get("/x/%C3%A9")).text == "é"
        for path in ("/x/%00", "/x/%ff", "/x/a?q=%00", "/x/a?q=%fe%ff"):
            r = await client.get(path)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_input", path


def test_callback_signatures_are_never_logged() -> None:
    from run_engine.api.http import redact

    assert redact("/api/v1/waitpoints/tokens/waitpoint_x/callback/SECRETSIG") == \
        "/api/v1/waitpoints/tokens/waitpoint_x/callback/[redacted]"
    assert redact("/api/v3/runs/run_x") == "/api/v3/runs/run_x"
    # routed decoded: its slashes or letters percent-encoded, the signature is still there
    for spelled in ("callback%2FSECRETSIG", "%63allback/SECRETSIG", "callback%2fSECRETSIG"):
        logged = redact(f"/api/v1/waitpoints/tokens/waitpoint_x/{spelled}")
        assert "SECRETSIG" not in logged and logged.endswith("/callback/[redacted]"), logged


async def test_a_large_body_is_scanned_off_the_loop_and_still_names_the_field() -> None:
    """A body of a million small values is walked in a thread (the loop's other requests go on), and
    a NUL at its end is found and named as in a small one."""
    from starlette.requests import Request

    from run_engine.api.http import SCAN_OFF_LOOP_BYTES, ApiError, read_json

    async def route(request: Request) -> PlainTextResponse:
        try:
            await read_json(request)
        except ApiError as exc:
            return PlainTextResponse(exc.message, 400)
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/", route, methods=["POST"])])
    wide = {"payload": [0] * 1_000_000, "deep": [{}] * (MAX_DEPTH + 1), "last": ["fine", "x\x00"]}
    body = orjson.dumps(wide)
    assert len(body) > SCAN_OFF_LOOP_BYTES
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/", content=body)
        assert (r.status_code, r.text.split(":")[0]) == (400, "last.1")
        wide["last"] = ["fine"]
        assert (await c.post("/", content=orjson.dumps(wide))).text == "ok"
