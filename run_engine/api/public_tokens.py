"""Public access tokens: the short-lived JWTs of Trigger.dev's SDK that a browser or another
service may hold instead of the environment's secret key (``auth.createPublicToken``, the
``publicAccessToken`` of a trigger, a batch or a waitpoint token, the realtime hooks).

A token is an HS256 JWT signed with the environment's secret API key, as the SDK signs it: claims
``sub`` (the environment id), ``pub: true``, ``iss``/``aud`` of Trigger.dev, ``exp``, and ``scopes``
(``read:runs:<id>``, ``read:tags:<tag>``, ``read:batch:<id>``, ``read:tasks:<task>``,
``read:runs``, ``read:all``, ``trigger:tasks:<task>``, ``batchTrigger:tasks:<task>``,
``write:waitpoints:<id>``, ``admin``...). The server holds no key in the clear: it derives the
environment's current key from the installation secret, so a rotated key ends every token signed
with the old one. ``otu: true`` makes a token good for one call (remembered in Redis until it
expires). No scopes grant nothing.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from dataclasses import dataclass
from typing import Any

import orjson

from run_engine.api.http import ApiError
from run_engine.tenancy import api_key_for, hash_secret

ISSUER = "https://id.trigger.dev"
AUDIENCE = "https://api.trigger.dev"
MAX_TOKEN_CHARS = 8192
MAX_SCOPES = 500
MAX_LIFETIME_S = 366 * 24 * 3600
LEEWAY_S = 5
#: what a public token may do at all; every other call answers 403 with this
PUBLIC_SCOPE = ("read the runs, batches and tags its scopes name (also as realtime streams), trigger the tasks "
                "they name and complete the waitpoint tokens they name")


@dataclass(frozen=True, slots=True)
class PublicClaims:
    env_id: str
    scopes: frozenset[str]
    expires_at: int
    one_time: bool


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def looks_like_jwt(token: str) -> bool:
    return token.startswith("eyJ") and token.count(".") == 2


def sign(key: str, claims: dict[str, Any]) -> str:
    """An HS256 JWT of ``claims`` signed with ``key`` (the environment's secret API key)."""
    head = _b64(orjson.dumps({"alg": "HS256", "typ": "JWT"}))
    body = _b64(orjson.dumps(claims))
    signature = hmac.new(key.encode(), f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{_b64(signature)}"


def unverified_claims(token: str) -> dict[str, Any]:
    """The claims of a JWT-shaped token before its signature is checked (only to find the key)."""
    if len(token) > MAX_TOKEN_CHARS:
        raise ApiError(401, "unauthorized", "invalid public access token: too long")
    try:
        head_part, body_part, _ = token.split(".")
        head = orjson.loads(_unb64(head_part))
        claims = orjson.loads(_unb64(body_part))
    except (ValueError, binascii.Error, orjson.JSONDecodeError):
        raise ApiError(401, "unauthorized", "invalid public access token: not a JWT") from None
    if not isinstance(head, dict) or head.get("alg") != "HS256":
        raise ApiError(401, "unauthorized", "invalid public access token: only HS256 is accepted")
    if not isinstance(claims, dict) or not isinstance(claims.get("sub"), str):
        raise ApiError(401, "unauthorized", "invalid public access token: no environment (sub)")
    return claims


def verify(token: str, key: str, claims: dict[str, Any], now: float) -> PublicClaims:
    """The claims of ``token`` once its signature (with ``key``) and its dates are good; 401 otherwise."""
    signed, _, signature = token.rpartition(".")
    expected = _b64(hmac.new(key.encode(), signed.encode(), hashlib.sha256).digest())
    if not hmac.compare_digest(signature.encode(), expected.encode()):
        raise ApiError(401, "unauthorized", "invalid public access token: bad signature (or the key was rotated)")
    if claims.get("pub") is not True:
        raise ApiError(401, "unauthorized", "invalid public access token: not a public token (pub)")
    if claims.get("iss") != ISSUER or claims.get("aud") != AUDIENCE:
        raise ApiError(401, "unauthorized", "invalid public access token: wrong issuer or audience")
    exp, nbf = claims.get("exp"), claims.get("nbf")
    if not isinstance(exp, int | float) or isinstance(exp, bool):
        raise ApiError(401, "unauthorized", "invalid public access token: no expiry (exp)")
    if exp + LEEWAY_S < now:
        raise ApiError(401, "unauthorized", "the public access token has expired")
    one_time = claims.get("otu") is True
    if one_time and exp > now + MAX_LIFETIME_S + LEEWAY_S:
        # its use is remembered until it expires: a record kept for ever (past Redis's bounds, a 500)
        raise ApiError(401, "unauthorized", f"invalid public access token: a one-time token may expire at most "
                                            f"{MAX_LIFETIME_S} s from now (exp)")
    if isinstance(nbf, int | float) and nbf - LEEWAY_S > now:
        raise ApiError(401, "unauthorized", "the public access token is not valid yet")
    raw = claims.get("scopes")
    scopes = raw if isinstance(raw, list) else []
    if len(scopes) > MAX_SCOPES:
        raise ApiError(401, "unauthorized", f"invalid public access token: more than {MAX_SCOPES} scopes")
    return PublicClaims(claims["sub"], frozenset(s for s in scopes if isinstance(s, str)), int(exp), one_time)


def token_identity(token: str) -> str:
    """A stable identity of a public access token: a digest of the token itself (its signed claims
    and signature, as checked), the same for every call made with it and another for any other
    token, even one of the same scopes (each browser user's token is another caller). Not the
    digest a one-time token's use is remembered by."""
    return hashlib.sha256(f"public-token.{token}".encode("utf-8", "surrogatepass")).hexdigest()


def environment_key(secret: str, env_id: str, env_type: str, generation: int, key_hash: str) -> str | None:
    """The environment's current secret key, derived again from the installation secret; None when
    the stored key was not derived from this secret (then no public token of it can be checked)."""
    key = api_key_for(secret, env_id, env_type, generation)
    return key if hmac.compare_digest(hash_secret(key), key_hash) else None


def mint(key: str, env_id: str, scopes: list[str], *, lifetime_s: int, one_time: bool = False,
         realtime: dict[str, Any] | None = None, now: float | None = None) -> str:
    """A public token the server signs itself (for a run token's caller, or POST /api/v1/auth/public-tokens)."""
    issued = int(time.time() if now is None else now)
    claims: dict[str, Any] = {"sub": env_id, "pub": True, "scopes": scopes, "iss": ISSUER, "aud": AUDIENCE,
                              "iat": issued, "exp": issued + max(1, min(lifetime_s, MAX_LIFETIME_S))}
    if one_time:
        claims["otu"] = True
    if realtime:
        claims["realtime"] = realtime
    return sign(key, claims)


def allows(scopes: frozenset[str] | None, *wanted: str) -> bool:
    """Whether a credential may act: a secret key or run token (``None``) always; a public token when
    one of ``wanted`` (or ``admin``) is among its scopes."""
    return scopes is None or "admin" in scopes or any(w in scopes for w in wanted)


def read_scopes(run_id: str, task: str, tags: list[str] | tuple[str, ...], batch_id: str | None) -> list[str]:
    """The scopes, any of which lets a public token read this run."""
    wanted = ["read:all", "read:runs", f"read:runs:{run_id}", f"read:tasks:{task}"]
    wanted += [f"read:tags:{t}" for t in tags]
    if batch_id:
        wanted.append(f"read:batch:{batch_id}")
    return wanted


def forbidden() -> ApiError:
    return ApiError(403, "forbidden", f"this public access token may only {PUBLIC_SCOPE}")
