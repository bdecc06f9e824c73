"""What the server refuses before anything is written (API.md, "Errors" and "Limits").

PostgreSQL cannot store the NUL character in ``text`` or ``jsonb``, and orjson (which serialises
every JSON column) refuses nesting deeper than 254 levels. Both would fail a whole grouped
statement, so they are caught here, per request, with the field named:

* a string (or object key) containing NUL (JSON ``\\u0000``) anywhere in a body → 400;
* JSON nested deeper than :data:`MAX_DEPTH` → 400;
* NUL in a path or query string → 400 (the :class:`RejectUnstorable` middleware).

The checks cost nothing on ordinary bodies: a body is walked only if its raw bytes contain the
``\\u0000`` escape, or more brackets than :data:`MAX_DEPTH` (so that it could be that deep).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote_to_bytes

from starlette.types import ASGIApp, Receive, Scope, Send

from run_engine.jsontext import stored_size

MAX_DEPTH = 100
#: the most JSON objects and arrays one stored value (a payload, an output, metadata, a step's
#: result, a token's data) may hold, counted as the `[` and `{` of its JSON text (those in its
#: strings too: a cheap upper bound). Every read of a run decodes its payload on the event loop
#: that every tenant's requests share: a 3 MiB payload of a million empty lists took half a second
#: a read; this many take ~30 ms at worst
MAX_CONTAINERS = 250_000
_NUL_ESCAPE = b"\\u0000"


def unstorable(value: Any, path: str = "body") -> str | None:
    """The first reason ``value`` cannot be stored, as ``"<field path>: <why>"``, or None.

    Only containers are pushed, each with a link to its parent for the message; strings and
    numbers are looked at in place and a field's path is spelled out only for the one at fault: a
    10 MiB body of small values is walked at C-ish speed instead of with a string and a tuple made
    per value (which held the event loop, and every tenant's requests on it, for seconds)."""
    Link = tuple[Any, Any] | None  # (parent link, key): the path to a container

    def where(link: Link, key: Any = None) -> str:
        keys = [] if key is None else [key]
        while link is not None:
            link, step = link
            keys.append(step)
        return path + "".join(f".{k}" for k in reversed(keys))

    def nul(at: str) -> str:
        return f"{at}: contains the NUL character (\\u0000), which run-engine cannot store"

    if isinstance(value, str):
        return nul(path) if "\x00" in value else None
    if not isinstance(value, dict | list):
        return None
    stack: list[tuple[Any, int, Link]] = [(value, 1, None)]
    while stack:
        item, depth, link = stack.pop()
        if depth > MAX_DEPTH:
            return f"{where(link)}: JSON is nested more than {MAX_DEPTH} levels deep"
        if isinstance(item, dict):
            for key in item:
                if isinstance(key, str) and "\x00" in key:
                    return (f"{where(link)}: an object key contains the NUL character (\\u0000), "
                            "which run-engine cannot store")
            pairs: Any = item.items()
        else:
            pairs = enumerate(item)
        for key, child in pairs:
            kind = type(child)
            if kind is str or (kind not in _PLAIN and isinstance(child, str)):
                if "\x00" in child:
                    return nul(where(link, key))
            elif kind is dict or kind is list or (kind not in _PLAIN and isinstance(child, dict | list)):
                stack.append((child, depth + 1, (link, key)))
    return None


_PLAIN = frozenset({int, float, bool, type(None)})  # what a JSON value holds besides str, dict and list


def is_number(raw: str) -> bool:
    """ASCII digits only (``str.isdigit`` also takes "²" and other digits that ``int`` refuses), at
    most 18 of them: a number PostgreSQL's bigint holds, and never one ``int`` refuses (past 4,300
    digits it raises)."""
    return raw.isascii() and raw.isdigit() and len(raw) <= 18


def too_many_containers(raw: bytes | bytearray | str) -> str | None:
    """Why a value's JSON text ``raw`` holds too many objects and arrays to be stored, or None."""
    if isinstance(raw, str):
        n = raw.count("[") + raw.count("{")
    else:
        n = raw.count(b"[") + raw.count(b"{")
    if n <= MAX_CONTAINERS:
        return None
    return (f"holds {n} JSON objects and arrays (counting brackets in its strings); at most "
            f"{MAX_CONTAINERS} are stored")


def too_large(raw: bytes | bytearray, limit: int) -> str | None:
    """Why the JSON text ``raw`` (orjson's) is too large to be stored under ``limit``, or None."""
    if len(raw) > limit:
        return f"larger than {limit} bytes"
    if (stored := stored_size(raw, limit)) > limit:
        return (f"larger than {limit} bytes as stored ({stored} at most: a number in exponent form is stored "
                "written out in full, 1e+308 as 309 digits)")
    return None


def needs_scan(raw: bytes | bytearray) -> bool:
    """Whether a JSON body could hold a NUL or be too deep (cheap C-speed byte searches)."""
    return _NUL_ESCAPE in raw or raw.count(b"[") + raw.count(b"{") > MAX_DEPTH


def first_nul(*values: Any) -> str | None:
    """The first of ``values`` (plain strings, or ``(name, value)`` pairs) that holds NUL."""
    for v in values:
        name: str
        name, s = v if isinstance(v, tuple) else ("value", v)
        if isinstance(s, str) and "\x00" in s:
            return name
    return None


# --- ids in paths ---------------------------------------------------------------------------------

_ID = re.compile(r"[a-z]{2,16}_[a-z0-9]{1,64}")


def looks_like_id(value: str, prefix: str) -> bool:
    """Whether ``value`` has the shape of an id we made with ``prefix`` (``run``, ``waitpoint``…).
    Anything else is answered 404 at once, without a query."""
    return value.startswith(prefix + "_") and _ID.fullmatch(value) is not None


# --- the middleware ---------------------------------------------------------------------------

class RejectUnstorable:
    """400 for a request whose path or query string holds NUL (``%00``) or bytes that are not
    UTF-8, before any route sees it: such a value can never name anything we store."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            problem = self._problem(scope)
            if problem is not None:
                from run_engine.api.http import json_response

                response = json_response({"error": {"code": "invalid_input", "message": problem}}, 400)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    def _problem(scope: Scope) -> str | None:
        raw_path: bytes = scope.get("raw_path") or scope.get("path", "").encode("utf-8", "surrogateescape")
        query: bytes = scope.get("query_string", b"")
        for part, raw in (("path", raw_path), ("query", query)):
            if not raw:
                continue
            decoded = unquote_to_bytes(raw.replace(b"+", b" ") if part == "query" else raw)
            if b"\x00" in decoded:
                return f"{part}: contains the NUL character (%00)"
            try:
                decoded.decode("utf-8")
            except UnicodeDecodeError:
                return f"{part}: is not valid UTF-8 once percent-decoded"
        return None
