"""jsontext.stored_size: a bound on a JSON text's length as PostgreSQL writes its jsonb back."""

from __future__ import annotations

import pytest

from run_engine import jsontext


@pytest.mark.parametrize("signed", [True, False])
def test_numbers_in_exponent_form_are_counted_whichever_way_orjson_writes_them(
        monkeypatch: pytest.MonkeyPatch, signed: bool) -> None:
    """orjson 3.13 writes 1e+308, 3.8 wrote 1e308 (the project asks for orjson>=3.9):
    both are 309 digits once stored, and the cheap bound must not let either through."""
    monkeypatch.setattr(jsontext, "_SIGNED_EXPONENTS", signed)
    raw = b"[1e+308,5e-324]" if signed else b"[1e308,5e-324]"
    assert jsontext.stored_size(raw, 0) >= 309 + 326
    ordinary = b'{"text":"one-time re-run","id":"550e8400-e29b-41d4-a716-446655440000"}'
    assert jsontext.stored_size(ordinary, 0) == len(ordinary)  # neither a word's e nor a UUID's 2e-41
    assert jsontext.stored_size(ordinary, len(ordinary) * 1000) == len(ordinary)
