"""Run tokens and callback signatures: HMAC-SHA256 with the installation's secret.

A run token lets an executor act for one run and one attempt until it expires; it never carries
the environment's secret key. Format: ``rt_<run_id>.<attempt>.<expires unix s>.<signature>``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass

PREFIX = "rt_"


@dataclass(frozen=True, slots=True)
class RunTokenClaims:
    run_id: str
    attempt: int
    expires_at: int


class RunTokens:
    def __init__(self, secret: str) -> None:
        self._key = secret.encode()
        self._packet_key = self.derive("packet")

    def _sign(self, message: str) -> str:
        digest = hmac.new(self._key, message.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def mint(self, run_id: str, attempt: int, expires_at: int) -> str:
        body = f"{run_id}.{attempt}.{expires_at}"
        return f"{PREFIX}{body}.{self._sign(body)}"

    def verify(self, token: str, now: float) -> RunTokenClaims | None:
        """The claims of a valid, unexpired token; None otherwise."""
        if not token.startswith(PREFIX):
            return None
        try:
            run_id, attempt, expires, signature = token[len(PREFIX):].rsplit(".", 3)
            claims = RunTokenClaims(run_id, int(attempt), int(expires))
        except ValueError:
            return None
        if not self.same(signature, self._sign(f"{run_id}.{attempt}.{expires}")):
            return None
        if claims.expires_at < now:
            return None
        return claims

    def derive(self, purpose: str) -> bytes:
        """A key for another use of the installation secret (dashboard sessions), the same in
        every server process, independent of the run-token key."""
        return hmac.new(self._key, f"derive.{purpose}".encode(), hashlib.sha256).digest()

    def packet_signature(self, purpose: str, subject: str, expires_at: int) -> str:
        """The signature of a URL that reads (``purpose`` "get") or writes ("put") one packet
        (``subject``: what it names) until ``expires_at``: the URL is its own credential. Under a
        key of its own: no packet URL's signature is ever a run token's or a callback's."""
        digest = hmac.new(self._packet_key, f"{purpose}.{expires_at}.{subject}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def packet_ok(self, purpose: str, subject: str, expires_at: int, signature: str, now: float) -> bool:
        return expires_at >= now and self.same(signature, self.packet_signature(purpose, subject, expires_at))

    def callback_signature(self, waitpoint_id: str) -> str:
        return self._sign(f"callback.{waitpoint_id}")

    def callback_ok(self, waitpoint_id: str, signature: str) -> bool:
        return self.same(signature, self.callback_signature(waitpoint_id))

    @staticmethod
    def same(given: str, expected: str) -> bool:
        """Constant-time comparison that also takes non-ASCII input (``hmac.compare_digest`` raises
        TypeError on a non-ASCII ``str``)."""
        return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode())
