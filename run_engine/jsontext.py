"""JSON text decoded with the cycle collector paused when it is large.

orjson holds the GIL for a whole call, so decoding in a thread does not free the event loop: what
bounds the time a decode holds every tenant's requests is the size of what is decoded (the API caps
the objects and arrays of a stored value and of a request body before decoding) and the collector:
a text of many small containers otherwise sets off collections of the whole heap, four times the
decoding's own cost."""

from __future__ import annotations

import gc
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
