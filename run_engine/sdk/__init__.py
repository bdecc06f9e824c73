"""Task authoring SDK: ``from run_engine.sdk import task, queue, runs, AbortTaskRunError``."""

from run_engine.sdk import runs
from run_engine.sdk.context import Context
from run_engine.sdk.errors import AbortTaskRunError, TaskError
from run_engine.sdk.tasks import Queue, RunHandle, Task, queue, task

__all__ = ["AbortTaskRunError", "Context", "Queue", "RunHandle", "Task", "TaskError", "queue", "runs", "task"]
