"""JSON text decoded with the cycle collector paused when it is large.

orjson holds the GIL for a whole call, so decoding in a thread does not free the event loop: what
bounds the time a decode holds every tenant's requests is the size of what is decoded (the API caps
the objects and arrays of a stored value and of a request body before decoding) and the collector:
a text of many small containers otherwise sets off collections of the whole heap, four times the
decoding's own cost."""

from __future__ import annotations

import gc
import re
from typing import Any

import orjson

#: from this size on, a text is decoded with the collector paused
LARGE_BYTES = 64 * 1024


def loads(data: str | bytes | bytearray | memoryview) -> Any:
    if len(data) < LARGE_BYTES or not gc.isenabled():
        return orjson.loads(data)
    gc.disable()
    try:
        return orjson.loads(data)
    finally:
        gc.enable()


#: a number as orjson writes it in exponent form (``1e+308``, ``-1.5e-7``; an older one (3.8 here) wrote
#: ``1e308``), ending where a JSON value ends (so not the ``2e-41`` inside a UUID)
_EXPONENT_FORM = re.compile(rb"[0-9]e([+-]?[0-9]{1,3})(?=[,\]}]|\Z)")
#: what a number in exponent form grows by at most as PostgreSQL gives its jsonb back: less than
#: its exponent (``5e-324`` comes back as 326 characters)
_MAX_GROWTH = 324
#: this orjson signs every exponent: counting ``e+`` and ``e-`` finds every number in exponent form
_SIGNED_EXPONENTS = orjson.dumps(1e308) == b"1e+308"


def stored_size(raw: bytes | bytearray, limit: int) -> int:
    """The length of the JSON text ``raw`` (orjson's) as PostgreSQL gives it back from a jsonb
    column, as far as ``limit`` tells: jsonb keeps a number as a decimal and writes it out in full,
    so ``1e+308`` (6 bytes) comes back as 309 digits, and a 3 MiB payload of them as 137 MB of text
    that every read of the run decoded (seconds each, on the event loop every tenant shares).
    ``len(raw)`` when even each ``e+`` and ``e-`` in it (each ``e`` with an orjson that writes
    ``1e308``) growing the most would keep it within ``limit`` (C-speed counts: every ordinary
    value); else ``len(raw)`` plus the exponents of its numbers in exponent form (an upper bound of
    what they grow by, one regex pass)."""
    n = len(raw)
    exponents = raw.count(b"e+") + raw.count(b"e-") if _SIGNED_EXPONENTS else raw.count(b"e")
    if n + exponents * _MAX_GROWTH <= limit:
        return n
    return n + sum(abs(int(e)) for e in _EXPONENT_FORM.findall(raw))
