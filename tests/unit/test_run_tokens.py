from __future__ import annotations

from run_engine.run_tokens import RunTokens


def test_run_token_round_trip_and_scope() -> None:
    tokens = RunTokens("secret")
    token = tokens.mint("run_abc", 2, 1000)
    claims = tokens.verify(token, 999)
    assert claims is not None and (claims.run_id, claims.attempt) == ("run_abc", 2)


def test_expired_tampered_and_foreign_tokens_are_rejected() -> None:
    tokens = RunTokens("secret")
    token = tokens.mint("run_abc", 1, 1000)
    assert tokens.verify(token, 1001) is None
    assert tokens.verify(token.replace("run_abc", "run_abd"), 10) is None
    assert RunTokens("other").verify(token, 10) is None
    assert tokens.verify("garbage", 10) is None and tokens.verify("rt_a.b.c.d", 10) is None
