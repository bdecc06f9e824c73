"""Public access tokens at their bounds: a one-time token whose expiry is past what its use can be
remembered for is refused (it was a 500), and the server never signs a token it would refuse."""

from __future__ import annotations

from typing import Any

from run_engine.api.public_tokens import AUDIENCE, ISSUER, MAX_LIFETIME_S, MAX_TOKEN_CHARS, sign

from .conftest import Harness, api_client


def signed(h: Harness, scopes: list[str], **claims: Any) -> str:
    now = int(h.clock.now())
    return sign(h.env.api_key, {"sub": h.env.env_id, "pub": True, "iss": ISSUER, "aud": AUDIENCE, "iat": now,
                                "exp": now + 600, "scopes": scopes, **claims})


async def test_a_one_time_token_expiring_too_far_ahead_is_refused_not_a_500(h: Harness) -> None:
    """The SDK signs it (its expiry is the caller's choice): the mark of its use was set in Redis
    until its expiry, which Redis refuses past its bounds (500), and would outlive every cap."""
    async with api_client(h) as api:
        run_id = (await api.post("/api/v1/tasks/hello/trigger", json={"payload": {}})).json()["id"]
    now = int(h.clock.now())
    for exp in (10**17, 1e300, now + MAX_LIFETIME_S + 3600):
        async with api_client(h, signed(h, [f"read:runs:{run_id}"], otu=True, exp=exp)) as api:
            got = await api.get(f"/api/v3/runs/{run_id}")
        assert got.status_code == 401, (exp, got.status_code, got.text)
        assert "one-time" in got.json()["error"]["message"]
    # within the bound: used once
    token = signed(h, [f"read:runs:{run_id}"], otu=True, exp=now + MAX_LIFETIME_S - 60)
    async with api_client(h, token) as api:
        assert (await api.get(f"/api/v3/runs/{run_id}")).status_code == 200
        assert (await api.get(f"/api/v3/runs/{run_id}")).status_code == 401
    # a token used many times may expire when its signer likes
    async with api_client(h, signed(h, [f"read:runs:{run_id}"], exp=10**17)) as api:
        assert (await api.get(f"/api/v3/runs/{run_id}")).status_code == 200


async def test_the_server_signs_no_token_it_would_refuse(h: Harness) -> None:
    """500 scopes of 512 characters were signed (200) into a token every request refused as too long."""
    async with api_client(h) as api:
        run_id = (await api.post("/api/v1/tasks/hello/trigger", json={"payload": {}})).json()["id"]
        scopes = [f"read:runs:{run_id}"] + [f"read:tags:{'t' * 100}{i}" for i in range(99)]
        made = await api.post("/api/v1/auth/public-tokens", json={"scopes": scopes})
        assert made.status_code == 400, made.text
        assert str(MAX_TOKEN_CHARS) in made.json()["error"]["message"]
        fits = await api.post("/api/v1/auth/public-tokens", json={"scopes": scopes[:20]})
        assert fits.status_code == 200, fits.text
    async with api_client(h, fits.json()["token"]) as api:
        assert (await api.get(f"/api/v3/runs/{run_id}")).status_code == 200
