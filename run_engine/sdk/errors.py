"""Errors a task author raises or sees."""

from __future__ import annotations


class AbortTaskRunError(Exception):
    """Raise it in a task to fail the run at once, without retries."""


class TaskError(Exception):
    """A call to the run-engine API failed; ``status`` and ``code`` come from the error body."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
