"""Dashboard sessions: a signed cookie naming the environment an API key signed in to.

The cookie holds ``<env id>.<key hash prefix>.<expires>.<csrf>.<signature>``, HMAC-signed with a key
derived from the installation secret (so every server process accepts it). The key hash prefix ties
the session to the key it was opened with: rotating the key ends its sessions. ``csrf`` is the token
every form and htmx request of the session must carry (the cookie is also SameSite=Strict).

A session's id is a digest of its signed body (the random ``csrf`` makes it unique), so sessions
opened before ids existed have one too. Signing out keeps that id in Redis (``<prefix>:dash:out:<id>``)
until the session would have expired: a copy of the cookie ends with it (core.signed_in checks it
on every request; nothing of it is cached). Those marks are complete only since Redis has kept them:
``<prefix>:dash:since`` holds the time (s) they are kept from, written when found missing (a new
installation, or Redis lost its data: a flush, a restart without persistence), and a session opened
before it is refused (sign in again): whether it was signed out is no longer known.
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
#: a signed-out mark outlives its session's expiry by this much (server processes' clocks differ a little)
SIGNED_OUT_LEEWAY_S = 60
#: a session opened this little before the marks' start is still taken (processes' clocks differ)
SINCE_LEEWAY_S = 2


def since_key(prefix: str) -> str:
    """The Redis key holding the time from which the signed-out marks are all there."""
    return f"{prefix}:dash:since"


@dataclass(frozen=True, slots=True)
class Session:
    env_id: str
    key_hash_prefix: str
    expires_at: int
    csrf: str

    @property
    def body(self) -> str:
        """What the cookie signs."""
        return f"{self.env_id}.{self.key_hash_prefix}.{self.expires_at}.{self.csrf}"

    @property
    def id(self) -> str:
        """The session's id: a digest of its signed body (no secret; it names the session)."""
        return base64.urlsafe_b64encode(hashlib.sha256(self.body.encode()).digest()[:18]).decode()

    def signed_out_key(self, prefix: str) -> str:
        """The Redis key marking this session signed out, under the installation's ``prefix``."""
        return f"{prefix}:dash:out:{self.id}"

    @property
    def opened_at(self) -> int:
        return self.expires_at - LIFETIME_S

    def known_since(self, since: int) -> bool:
        """Whether a sign-out of this session would be among the marks kept from ``since``."""
        return self.opened_at + SINCE_LEEWAY_S >= since

    def signed_out_ttl_s(self, now: float) -> int:
        """How long the signed-out mark must live: the session's remaining lifetime, and a leeway."""
        return max(1, self.expires_at - int(now)) + SIGNED_OUT_LEEWAY_S


class Sessions:
    def __init__(self, key: bytes) -> None:
        self._key = key

    def _sign(self, body: str) -> str:
        digest = hmac.new(self._key, body.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def open(self, env_id: str, key_hash: str, now: float) -> tuple[Session, str]:
        """A new session and its cookie value."""
        session = Session(env_id, key_hash[:16], int(now) + LIFETIME_S, secrets.token_urlsafe(18))
        return session, f"{session.body}.{self._sign(session.body)}"

    def read(self, value: str | None, now: float) -> Session | None:
        """The session of a cookie value: signed by us and not expired; None otherwise (whether it
        was signed out is Redis's to say: core.signed_in)."""
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
