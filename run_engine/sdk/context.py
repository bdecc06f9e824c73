"""``ctx``: what a running task knows about itself."""

from __future__ import annotations

from dataclasses import dataclass, field


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
