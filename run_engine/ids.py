"""Friendly, prefixed, random ids (never sequential): ``run_``, ``snapshot_``, ``waitpoint_``…"""

from __future__ import annotations

import base64
import secrets


def new_id(prefix: str) -> str:
    """``new_id("run")`` → ``run_`` + 24 random base32 characters (120 bits)."""
    return f"{prefix}_{base64.b32encode(secrets.token_bytes(15)).decode().lower()}"
