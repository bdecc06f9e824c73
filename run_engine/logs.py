"""Logging for the long-running commands: text by default, one JSON object per line with
``--json`` or ``RUN_ENGINE_LOG_FORMAT=json`` (level from ``RUN_ENGINE_LOG_LEVEL``). Fields given as
``extra={...}`` are JSON keys, or ``key=value`` pairs after the message in text."""

from __future__ import annotations

import logging
import os
import sys
from datetime import UTC, datetime
from typing import Any

import orjson

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


_STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "color_message"}


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The ``extra={...}`` fields of a record."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "message", "exc"?}`` plus any ``extra={...}`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat().replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(extra_fields(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    """:data:`TEXT_FORMAT` followed by the record's extra fields as ``key=value`` (a value with a
    space, a quote, ``=`` or a control character is quoted, so one record stays one line)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = extra_fields(record)
        if not fields:
            return line
        pairs = " ".join(f"{key}={_text_value(value)}" for key, value in fields.items())
        head, sep, tail = line.partition("\n")  # a traceback goes after the fields
        return f"{head} {pairs}{sep}{tail}"


def _text_value(value: Any) -> str:
    if isinstance(value, dict | list | tuple):
        text = orjson.dumps(value, default=str).decode()
    else:
        text = str(value)
    if text and text.isprintable() and not any(c in text for c in ' "='):
        return text
    return orjson.dumps(text).decode()  # quoted, with control characters escaped


def configure(json: bool | None = None, level: str | None = None) -> None:
    """(Re)configure the root logger; ``json`` None reads ``RUN_ENGINE_LOG_FORMAT``."""
    if json is None:
        json = os.environ.get("RUN_ENGINE_LOG_FORMAT", "text").lower() == "json"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level or os.environ.get("RUN_ENGINE_LOG_LEVEL", "INFO").upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if json:  # uvicorn logs through its own handlers; route them through ours
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            logger = logging.getLogger(name)
            logger.handlers.clear()
            logger.propagate = True
