"""``wait``: pause a running task for a duration, until a date, or until a token is completed.

Each wait is a waitpoint the run blocks on. A short wait continues in the same executor; past the
supervisor's grace period (``RUN_ENGINE_SUSPEND_AFTER_S``) the run is checkpointed, its executor
and concurrency slot are released, and it is restored by journal replay when the wait is over.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from run_engine.sdk import runtime


@dataclass(frozen=True, slots=True)
class WaitResult:
    """The outcome of ``wait.for_token``: ``ok`` with ``output``, or not ok with ``error`` (the
    token timed out)."""

    ok: bool
    output: Any = None
    error: Any = None

    def unwrap(self) -> Any:
        if not self.ok:
            raise WaitpointTimeoutError(self.error)
        return self.output


class WaitpointTimeoutError(Exception):
    def __init__(self, error: Any) -> None:
        super().__init__((error or {}).get("message", "the waitpoint timed out") if isinstance(error, dict)
                         else str(error))
        self.error = error


class _Wait:
    async def for_(self, *, seconds: float = 0, minutes: float = 0, hours: float = 0, days: float = 0) -> None:
        """Wait for a duration (a DATETIME waitpoint)."""
        total = seconds + 60 * minutes + 3600 * hours + 86400 * days
        if total < 0:
            raise ValueError("a wait cannot be negative")
        await runtime.require("wait.for_").wait("wait", seconds=total)

    async def until(self, date: datetime) -> None:
        """Wait until ``date`` (naive dates are UTC)."""
        when = date if date.tzinfo else date.replace(tzinfo=UTC)
        await runtime.require("wait.until").wait("wait", date=when.isoformat())

    async def for_token(self, token: Any) -> WaitResult:
        """Wait until the token (its id, or what ``tokens.create`` returned) is completed or times
        out; never raises on a timeout: look at ``ok``."""
        token_id = token if isinstance(token, str) else token.id
        result = await runtime.require("wait.for_token").wait("token", waitpointId=token_id)
        return WaitResult(result["ok"], result.get("output"), result.get("error"))


    async def for_run(self, run: Any) -> WaitResult:
        """Wait until another run of the environment (its id, or what ``trigger`` returned) has
        finished: ``ok`` with its ``output``, or its ``error``. At once if it finished already.
        The run itself, or one it descends from through parents that each wait on their child
        (its parent that called ``trigger_and_wait``...), would finish only after the wait: not ok
        at once then, with an error of type ``WAIT_DEADLOCK``."""
        run_id = run if isinstance(run, str) else run.id
        result = await runtime.require("wait.for_run").wait("token", waitpointId=run_id)
        return WaitResult(result["ok"], result.get("output"), result.get("error"))


wait = _Wait()
