"""Public access tokens against a real server, as an attacker would try them: only a token signed
with the environment's current key, unexpired, public, of Trigger.dev's issuer and audience, acts,
and only on what its scopes name; forgeries are a 401, never a 500; a rotated key ends them all.
The realtime shapes over many runs (tags, a batch) answer every change, and refuse what a token
does not cover."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import httpx
import orjson
import pytest

from run_engine.api.public_tokens import AUDIENCE, ISSUER, sign

from .conftest import Stack


@pytest.fixture(scope="module")
def own(stack: Stack) -> Stack:
    """A project of its own (its key is rotated at the end), with no worker: runs stay QUEUED."""
    return stack.project("public-tokens")


def env_id_of(s: Stack) -> str:
    with s.client() as c:
        claims = c.post("/api/v1/auth/jwt/claims").json()
    assert claims["pub"] is True and claims["sub"].startswith("env_")
    return str(claims["sub"])


def token(s: Stack, scopes: list[str], *, key: str | None = None, **over: Any) -> str:
    now = int(time.time())
    sub = over.pop("sub") if "sub" in over else env_id_of(s)
    claims = {"sub": sub, "pub": True, "iss": ISSUER, "aud": AUDIENCE, "iat": now, "exp": now + 600,
              "scopes": scopes, **over}
    return sign(key or s.api_key, {k: v for k, v in claims.items() if v is not None})


def as_token(s: Stack, tok: str) -> httpx.Client:
    return s.client(tok)


def test_a_token_reads_only_what_its_scopes_name(own: Stack) -> None:
    mine, other = own.trigger("echo", {"n": 1}, tags=["shared"]), own.trigger("echo", {"n": 2})
    with as_token(own, token(own, [f"read:runs:{mine}"])) as c:
        assert c.get(f"/api/v3/runs/{mine}").json()["id"] == mine
        assert c.get(f"/api/v3/runs/{other}").status_code == 403
        for method, path in (("GET", "/api/v1/runs"), ("POST", f"/api/v2/runs/{mine}/cancel"),
                             ("POST", f"/api/v1/runs/{mine}/replay"), ("GET", "/api/v1/queues"),
                             ("POST", "/api/v1/auth/public-tokens"), ("GET", "/api/v1/dlq")):
            r = c.request(method, path, json={})
            assert r.status_code == 403 and "public access token" in r.json()["error"]["message"], (path, r.text)
        with c.stream("GET", f"/realtime/v1/runs/{mine}") as sse:  # the SSE stream of its run
            assert sse.status_code == 200
    with as_token(own, token(own, ["read:tags:shared"])) as c:
        assert c.get(f"/api/v3/runs/{mine}").status_code == 200
        assert c.get(f"/api/v3/runs/{other}").status_code == 403
    with as_token(own, token(own, [])) as c:  # no scopes: nothing, not everything
        assert c.get(f"/api/v3/runs/{mine}").status_code == 403
    with as_token(own, token(own, ["admin"])) as c:
        assert c.get(f"/api/v3/runs/{other}").status_code == 200
    with as_token(own, token(own, ["trigger:tasks:echo"])) as c:  # never names another tenant's run a parent
        r = c.post("/api/v1/tasks/echo/trigger", json={"options": {"parentRunId": mine}})
        assert r.status_code == 403 and "parent" in r.json()["error"]["message"]


def test_forged_expired_and_foreign_tokens_are_refused(own: Stack, stack: Stack) -> None:
    run_id = own.trigger("echo", {"n": 3})
    scopes = [f"read:runs:{run_id}"]
    head = base64.urlsafe_b64encode(b'{"alg":"none","typ":"JWT"}').decode().rstrip("=")
    body = base64.urlsafe_b64encode(orjson.dumps({"sub": env_id_of(own), "pub": True, "iss": ISSUER, "aud": AUDIENCE,
                                                  "exp": int(time.time()) + 600, "scopes": ["admin"]})).decode()
    forged = {
        "alg none": f"{head}.{body.rstrip('=')}.",
        "another key": token(own, scopes, key="tr_dev_not-the-key"),
        "expired": token(own, scopes, exp=int(time.time()) - 60),
        "not yet": token(own, scopes, nbf=int(time.time()) + 600),
        "not public": token(own, scopes, pub=None),
        "no expiry": token(own, scopes, exp=None),
        "other issuer": token(own, scopes, iss="https://evil.example"),
        "other tenant's key": token(own, scopes, key=stack.api_key),  # signed by another environment
        "unknown env": token(own, scopes, sub="env_aaaaaaaaaaaaaaaaaaaaaaaa"),
        "not an id": token(own, scopes, sub="../../x"),
        "garbage": "eyJhbGciOiJIUzI1NiJ9.!!!.x",
        "huge": "eyJ" + "a" * 20_000 + ".b.c",
    }
    with own.client() as c:
        for name, tok in forged.items():
            r = c.get(f"/api/v3/runs/{run_id}", headers={"Authorization": f"Bearer {tok}"})
            assert r.status_code == 401, (name, r.status_code, r.text)
            assert "public access token" in r.json()["error"]["message"], name
    # a token of another environment, however scoped, never reaches this one's runs
    with as_token(stack, token(stack, ["admin", f"read:runs:{run_id}"])) as c:
        assert c.get(f"/api/v3/runs/{run_id}").status_code == 404
    # the worker API and the dashboard take none
    with httpx.Client(base_url=own.url, headers={"Authorization": f"Bearer {token(own, ['admin'])}"}) as c:
        assert c.get("/engine/v1/worker-actions/runs/run_aaaaaaaaaaaaaaaaaaaaaaaa/snapshots/latest").status_code == 401


def test_tokens_the_server_signs(own: Stack) -> None:
    run_id = own.trigger("echo", {"n": 4})
    with own.client() as c:
        made = c.post("/api/v1/auth/public-tokens", json={"scopes": [f"read:runs:{run_id}"], "expirationTime": "1h"})
        assert made.status_code == 200, made.text
        claims = json.loads(base64.urlsafe_b64decode(made.json()["token"].split(".")[1] + "=="))
        assert claims["sub"] == env_id_of(own) and claims["pub"] is True
        assert 3500 <= claims["exp"] - claims["iat"] <= 3600 and claims["scopes"] == [f"read:runs:{run_id}"]
        bad: dict[str, Any]
        for bad in ({"scopes": []}, {"scopes": ["read:all"], "expirationTime": "soon"},
                    {"scopes": ["read:all"], "expirationTime": int(time.time()) - 10}, {"scopes": "read:all"}):
            r = c.post("/api/v1/auth/public-tokens", json=bad)
            assert r.status_code == 400, (bad, r.text)
        made_once = c.post("/api/v1/auth/public-tokens", json={"scopes": ["admin"], "oneTimeUse": True}).json()
        triggered = c.post("/api/v1/tasks/echo/trigger", json={"payload": 1})
        assert json.loads(triggered.headers["x-trigger-jwt-claims"]) == {"sub": env_id_of(own), "pub": True}
    with as_token(own, made.json()["token"]) as c:
        assert c.get(f"/api/v3/runs/{run_id}").status_code == 200
    with as_token(own, made_once["token"]) as c:
        assert c.get(f"/api/v3/runs/{run_id}").status_code == 200
        assert c.get(f"/api/v3/runs/{run_id}").status_code == 401


def _shape(c: httpx.Client, path: str, **params: str) -> tuple[list[dict[str, Any]], str]:
    r = c.get(path, params=params, timeout=40)
    assert r.status_code == 200, r.text
    return r.json(), r.headers["electric-offset"]


def test_shapes_of_tags_and_batches(own: Stack) -> None:
    tag = f"shape-{time.time_ns()}"
    first = own.trigger("echo", {"n": 5}, tags=[tag])
    with as_token(own, token(own, [f"read:tags:{tag}"])) as c:
        messages, offset = _shape(c, "/realtime/v1/runs", tags=tag, offset="-1")
        assert [m["value"]["id"] for m in messages if "value" in m] == [first]
        assert messages[-1] == {"headers": {"control": "up-to-date"}}
        # nothing changed: a live request answers up-to-date alone after its wait; a new run is an insert
        second = own.trigger("echo", {"n": 6}, tags=[tag])
        messages, offset = _shape(c, "/realtime/v1/runs", tags=tag, offset=offset, live="true")
        assert [(m["value"]["id"], m["headers"]["operation"]) for m in messages if "value" in m] == [(second, "insert")]
        with own.client() as api:
            assert api.post(f"/api/v2/runs/{first}/cancel").status_code == 200
        messages, offset = _shape(c, "/realtime/v1/runs", tags=tag, offset=offset, live="true")
        changed = {m["value"]["id"]: m["value"]["status"] for m in messages if "value" in m}
        # a run changed shortly before the offset may be sent again (a late commit is never lost)
        assert changed[first] == "CANCELED" and set(changed) <= {first, second}
        assert c.get("/realtime/v1/runs", params={"tags": f"{tag},other", "offset": "-1"}).status_code == 403
    with own.client() as c:
        assert c.get("/realtime/v1/runs", params={"offset": "-1"}).status_code == 400  # no tags
        r = c.get("/realtime/v1/runs", params={"tags": tag, "offset": "nonsense", "live": "true"})
        assert r.status_code == 400 and "offset" in r.json()["error"]["message"]
        made = c.post("/api/v1/tasks/batch", json={"items": [{"task": "echo", "payload": i} for i in range(3)]})
        batch_id = made.json()["id"]
        assert json.loads(made.headers["x-trigger-jwt-claims"])["pub"] is True
    with as_token(own, token(own, [f"read:batch:{batch_id}"])) as c:
        messages, offset = _shape(c, f"/realtime/v1/batches/{batch_id}", offset="-1")
        ids = sorted(m["value"]["id"] for m in messages if "value" in m)
        assert ids == sorted(r["id"] for r in made.json()["runs"])
        assert c.get(f"/api/v1/batches/{batch_id}").status_code == 200
    with as_token(own, token(own, [f"read:tags:{tag}"])) as c:
        assert c.get(f"/realtime/v1/batches/{batch_id}", params={"offset": "-1"}).status_code == 403


def test_a_trigger_only_token_gets_no_read_token_for_a_run_found_by_its_key(own: Stack) -> None:
    """The key may be another user's: a scoped caller learns the run's id, not a way to read it."""
    with own.client() as c:  # someone's run, made with the secret key
        theirs = c.post("/api/v1/tasks/echo/trigger", json={"payload": {"card": "4242"},
                                                            "options": {"idempotencyKey": "order-42"}}).json()["id"]
    with as_token(own, token(own, ["trigger:tasks:echo"])) as c:
        fresh = c.post("/api/v1/tasks/echo/trigger", json={"options": {"idempotencyKey": "order-43"}})
        assert fresh.status_code == 200 and "x-trigger-jwt" in fresh.headers  # its own new run: readable
        found = c.post("/api/v1/tasks/echo/trigger", json={"options": {"idempotencyKey": "order-42"}})
        assert found.status_code == 200 and found.json() == {"id": theirs, "isCached": True}
        assert "x-trigger-jwt" not in found.headers


def test_a_rotated_key_ends_its_tokens(own: Stack) -> None:
    run_id = own.trigger("echo", {"n": 7})
    env_id = env_id_of(own)
    tok = token(own, [f"read:runs:{run_id}"])
    with as_token(own, tok) as c:
        assert c.get(f"/api/v3/runs/{run_id}").status_code == 200
        out = own.cli("keys", "rotate", "--org", "e2e", "--project", "public-tokens", "--env", "dev", "--json")
        new_key = json.loads(out.stdout)["apiKey"]
        deadline = time.monotonic() + 30  # servers cache an environment for a few seconds
        while c.get(f"/api/v3/runs/{run_id}").status_code != 401:
            assert time.monotonic() < deadline, "a token of the rotated-away key still works"
            time.sleep(0.2)
    with as_token(own, token(own, [f"read:runs:{run_id}"], key=new_key, sub=env_id)) as c:
        assert c.get(f"/api/v3/runs/{run_id}").status_code == 200

