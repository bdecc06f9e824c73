"""Tasks for tests/unit/test_executor_hostile.py: errors, step results and leftovers a task's code
may produce, which must fail (or finish) its run cleanly and leave its executor fit for the next."""

from __future__ import annotations

import datetime
from typing import Any

from run_engine.sdk import task


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this exception cannot be printed")


@task(id="raises-unprintable")
async def raises_unprintable(payload: Any) -> None:
    raise _Unprintable()


@task(id="raises-surrogate")
async def raises_surrogate(payload: Any) -> None:
    raise ValueError("half a character: \ud800")  # not UTF-8: orjson refuses it


@task(id="raises-huge")
async def raises_huge(payload: int) -> None:
    raise ValueError("x" * payload)


@task(id="ok")
async def ok(payload: Any) -> str:
    return "ok"


@task(id="step-of-python-values")
async def step_of_python_values(payload: Any, ctx: Any) -> str:
    """A step whose result JSON stores differently (a date, NaN, a tuple): what the task sees."""
    value = await ctx.step("values", lambda: {"at": datetime.datetime(2024, 1, 2, 3, 4, 5), "nan": float("nan"),
                                              "pair": (1, 2)})
    return repr(value)
