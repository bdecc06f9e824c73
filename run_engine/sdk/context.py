"""``ctx``: what a running task knows about itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from run_engine.sdk import runtime


@dataclass(frozen=True, slots=True)
class RunInfo:
    id: str
    tags: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class AttemptInfo:
    number: int


@dataclass(frozen=True, slots=True)
class TaskInfo:
    id: str


@dataclass(frozen=True, slots=True)
class QueueInfo:
    name: str


@dataclass(frozen=True, slots=True)
class Context:
    run: RunInfo
    attempt: AttemptInfo
    task: TaskInfo
    queue: QueueInfo

    async def step(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args)`` once for this run: its (JSON) result is journaled, and a replay of the
        run returns the recorded result instead of calling ``fn`` again. Put side effects here."""
        return await runtime.require("ctx.step").step(name, fn, *args, **kwargs)
