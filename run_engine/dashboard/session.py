"""Dashboard sessions: a signed cookie naming the environment an API key signed in to.

The cookie holds ``<env id>.<key hash prefix>.<expires>.<csrf>.<signature>``, HMAC-signed with a key
derived from the installation secret (so every server process accepts it). The key hash prefix ties
the session to the key it was opened with: rotating the key ends its sessions. ``csrf`` is the token
every form and htmx request of the session must carry (the cookie is also SameSite=Strict).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

COOKIE = "re_session"
LOGIN_COOKIE = "re_login"  # the sign-in form's own CSRF token (double submit)
LIFETIME_S = 12 * 3600
PATH = "/dashboard"


@dataclass(frozen=True, slots=True)
class Session:
    env_id: str
    key_hash_prefix: str
    expires_at: int
    csrf: str


class Sessions:
    def __init__(self, key: bytes) -> None:
        self._key = key

    def _sign(self, body: str) -> str:
        digest = hmac.new(self._key, body.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def open(self, env_id: str, key_hash: str, now: float) -> tuple[Session, str]:
        """A new session and its cookie value."""
        session = Session(env_id, key_hash[:16], int(now) + LIFETIME_S, secrets.token_urlsafe(18))
        body = f"{session.env_id}.{session.key_hash_prefix}.{session.expires_at}.{session.csrf}"
        return session, f"{body}.{self._sign(body)}"

    def read(self, value: str | None, now: float) -> Session | None:
        """The session of a cookie value: signed by us and not expired; None otherwise."""
        if not value or len(value) > 512:
            return None
        try:
            body, signature = value.rsplit(".", 1)
            env_id, prefix, expires, csrf = body.split(".")
            session = Session(env_id, prefix, int(expires), csrf)
        except ValueError:
            return None
        if not same(signature, self._sign(body)) or session.expires_at < now:
            return None
        return session


def same(given: str, expected: str) -> bool:
    """Constant-time comparison that takes any text."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass"))


def secure(request: Request) -> bool:
    """Mark cookies Secure when the page was served over HTTPS (directly or behind a proxy)."""
    return request.url.scheme == "https" or request.headers.get("x-forwarded-proto") == "https"


def set_cookie(response: Response, request: Request, name: str, value: str, max_age: int) -> None:
    response.set_cookie(name, value, max_age=max_age, path=PATH, httponly=True, samesite="strict",
                        secure=secure(request))


def clear_cookie(response: Response, request: Request, name: str) -> None:
    response.delete_cookie(name, path=PATH, httponly=True, samesite="strict", secure=secure(request))
