"""Locate the SQL migrations and Lua scripts, from a source checkout or an installed wheel."""

from __future__ import annotations

from functools import cache
from pathlib import Path

_HERE = Path(__file__).resolve().parent


@cache
def data_dir(name: str) -> Path:
    """Return the directory holding ``name`` (``"lua"`` or ``"migrations"``).

    A wheel carries them under ``run_engine/_data/``; a source checkout (also an editable
    install) has them at the repository's top level.
    """
    for candidate in (_HERE / "_data" / name, _HERE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"run-engine data directory {name!r} not found next to {_HERE}")


def read_text(kind: str, filename: str) -> str:
    return (data_dir(kind) / filename).read_text(encoding="utf-8")
