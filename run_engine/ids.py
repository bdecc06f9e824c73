"""Friendly, prefixed, random ids (never sequential): ``run_``, ``snapshot_``, ``waitpoint_``…"""

from __future__ import annotations

import os

_BATCH = 256  # ids drawn from the OS at once: one getrandom call and one translation per batch
_SYMBOLS = b"abcdefghijklmnopqrstuvwxyz234567"  # base32's, lower case
# each random byte becomes the symbol of its low 5 bits: 256 is 8 x 32, so every symbol is equally
# likely and a character carries 5 random bits, 120 in an id's 24 (as base32 of 15 bytes, in C)
_TO_SYMBOL = bytes(_SYMBOLS[b % 32] for b in range(256))
_pool: list[str] = []


def _refill() -> list[str]:
    text = os.urandom(24 * _BATCH).translate(_TO_SYMBOL).decode()
    return [text[i:i + 24] for i in range(0, len(text), 24)]


def _forget() -> None:
    """A forked child must never hand out the ids its parent may hand out too."""
    _pool.clear()


os.register_at_fork(after_in_child=_forget)


def new_id(prefix: str) -> str:
    """``new_id("run")`` → ``run_`` + 24 random base32 characters (120 bits, from the OS's
    cryptographic source, drawn a batch at a time)."""
    try:
        suffix = _pool.pop()  # atomic: threads never share an id
    except IndexError:
        fresh = _refill()
        suffix = fresh.pop()
        _pool.extend(fresh)
    return f"{prefix}_{suffix}"
