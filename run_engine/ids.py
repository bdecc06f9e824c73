"""Friendly, prefixed, random ids (never sequential): ``run_``, ``snapshot_``, ``waitpoint_``…"""

from __future__ import annotations

import base64
import os

_BATCH = 256  # ids drawn from the OS at once: one getrandom call and one base32 encoding per batch
_pool: list[str] = []


def _refill() -> list[str]:
    # 15 random bytes are exactly 24 base32 characters, so one long encoding cut every 24
    # characters is the encoding of each 15 bytes on its own
    text = base64.b32encode(os.urandom(15 * _BATCH)).decode().lower()
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
