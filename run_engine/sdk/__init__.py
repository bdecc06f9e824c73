"""Task authoring SDK: ``from run_engine.sdk import task, wait, queue, tokens, runs, metadata, AbortTaskRunError``."""

from run_engine.sdk import metadata, runs, tokens
from run_engine.sdk.context import Context
from run_engine.sdk.errors import AbortTaskRunError, TaskError
from run_engine.sdk.runtime import NonDeterminismError
from run_engine.sdk.tasks import (
           BatchItemsFailedError,
           Queue,
           RunHandle,
           RunResult,
           Task,
           TaskRunFailedError,
           queue,
           task,
)
from run_engine.sdk.waits import WaitpointTimeoutError, WaitResult, wait

__all__ = ["AbortTaskRunError", "BatchItemsFailedError", "Context", "NonDeterminismError", "Queue", "RunHandle",
           "RunResult", "Task",
           "TaskError", "TaskRunFailedError", "WaitResult", "WaitpointTimeoutError", "metadata", "queue", "runs",
           "task", "tokens", "wait"]
