"""Run-engine's own benchmarks, bench/lifecycle.py and bench/http_e2e.py, run unchanged but for CPU phase markers.

    .venv/bin/python bench/peers/run_engine_bench.py lifecycle --runs 5000
    .venv/bin/python bench/peers/run_engine_bench.py http --runs 5000

The target module is imported and its `main()` called with the remaining arguments. Before that, its functions
that bound the measured window get a wrapper that prints the ``@@phase`` markers of bench/peers/common.py, so
that bench/peers.py reads the CPU counters of all processes exactly around the full-load phase:

- lifecycle: `cpu_s()`, which lifecycle calls right before its first trigger and right after its last completion;
- http: the second `phase()` call (the full-load one, after the warm-up) starts the window and the `wait_done()`
  it makes ends it (so neither the warm-up, the runs listing for latencies nor the half-load phase is counted).

If those functions are gone (the benchmarks were refactored) the run goes on without markers and bench/peers.py
falls back to the CPU of the whole run. The script's last stdout line is ``@@result <json>`` parsed from the
benchmark's own output: runs/s (both are producers and consumers at once: the "concurrent" mode) and, for http,
the half-load trigger→start p50/p99.
"""

from __future__ import annotations

import importlib
import io
import re
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TextIO

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))

from common import emit_result, log, phase_marker  # noqa: E402


class Tee(io.TextIOBase):
    """Writes through to the real stdout and keeps a copy to parse."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.copy = io.StringIO()

    def write(self, s: str) -> int:
        self.copy.write(s)
        n = self.out.write(s)
        self.out.flush()
        return n

    def flush(self) -> None:
        self.out.flush()


def hook_lifecycle(mod: Any) -> bool:
    orig = getattr(mod, "cpu_s", None)
    if orig is None:
        return False
    calls = 0

    def cpu_s() -> float:
        # main() runs twice: --enqueue-first (calls 1, 2: the batch mode), then as is (3, 4: concurrent)
        nonlocal calls
        calls += 1
        mode = "batch" if calls <= 2 else "concurrent"
        if calls in (1, 3):
            phase_marker("start", mode)
            return float(orig())
        value = float(orig())
        if calls in (2, 4):
            phase_marker("end", mode)
        return value

    mod.cpu_s = cpu_s
    return True


def hook_http(mod: Any) -> bool:
    orig_phase: Callable[..., Awaitable[Any]] | None = getattr(mod, "phase", None)
    orig_wait: Callable[..., Awaitable[Any]] | None = getattr(mod, "wait_done", None)
    if orig_phase is None or orig_wait is None:
        return False
    state = {"calls": 0, "measuring": False}

    async def phase(*args: Any, **kwargs: Any) -> Any:
        assert orig_phase is not None
        state["calls"] += 1
        if state["calls"] == 2:  # 1: warm-up, 2: full load, 3: half load
            phase_marker("start", "concurrent")
            state["measuring"] = True
        return await orig_phase(*args, **kwargs)

    async def wait_done(*args: Any, **kwargs: Any) -> Any:
        assert orig_wait is not None
        result = await orig_wait(*args, **kwargs)
        if state["measuring"]:
            state["measuring"] = False
            phase_marker("end", "concurrent")
        return result

    mod.phase, mod.wait_done = phase, wait_done
    return True


def runs_arg(argv: list[str], default: int) -> int:
    for i, a in enumerate(argv):
        if a == "--runs" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--runs="):
            return int(a.split("=", 1)[1])
    return default


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("lifecycle", "http"):
        raise SystemExit("usage: run_engine_bench.py lifecycle|http [benchmark args]")
    which, rest = sys.argv[1], sys.argv[2:]
    result: dict[str, Any] = {}
    try:
        mod = importlib.import_module("bench.lifecycle" if which == "lifecycle" else "bench.http_e2e")
        hooked = hook_lifecycle(mod) if which == "lifecycle" else hook_http(mod)
        if not hooked:
            log(f"run_engine_bench: no hook points in {mod.__name__}; CPU will be that of the whole run")
        tee = Tee(sys.stdout)
        real, sys.stdout = sys.stdout, tee
        try:
            if which == "lifecycle":  # the batch mode first: enqueue all, then drain
                sys.argv = [str(mod.__file__), *rest, "--enqueue-first"]
                mod.main()
            sys.argv = [str(mod.__file__), *rest]
            mod.main()
        finally:
            sys.stdout = real
        text = tee.copy.getvalue()
    except BaseException as exc:
        emit_result({"error": f"{type(exc).__name__}: {exc}"[:300]})
        raise
    if which == "lifecycle":
        runs = runs_arg(rest, 5000)
        rates = re.findall(r"^lifecycle runs/s: ([\d.]+)\s*$", text, re.M)
        result["jobs"] = 2 * runs
        started = " the dequeue starts the attempts," if "--start-in-dequeue" in rest else ""
        result["how"] = ("in process: bench/lifecycle.py (batch: --enqueue-first, trigger_many of 500; concurrent: "
                         f"16 producers; 32 consumers, dequeue batch 20,{started} pool 8)")
        if len(rates) == 2:
            result["batch"] = {"jobs_s": float(rates[0])}
        concurrent = rates[-1] if rates else None
    else:
        runs = runs_arg(rest, 3000)
        m = re.search(r"^http e2e runs/s: ([\d.]+)\s*$", text, re.M)
        concurrent = m.group(1) if m else None
        result["jobs"] = 200 + runs + runs // 2  # warm-up, full load, half load
        result["how"] = ("bench/http_e2e.py: run-engine server + supervisor (concurrency 16, warm executor "
                         "processes) + 32 raw HTTP/1.1 clients")
        half = re.search(r"^half\s+([\d.]+)\s+([\d.na]+)\s+([\d.na]+)\s*$", text, re.M)
        if half:
            result["latency"] = {"rate": float(half.group(1)), "p50_ms": _num(half.group(2)),
                                 "p99_ms": _num(half.group(3))}
    if concurrent is None:
        emit_result({"error": f"no runs/s line in the output of {which}"})
        raise SystemExit(1)
    result["runs"] = runs
    result["concurrent"] = {"jobs_s": float(concurrent)}
    result["cpu_scope"] = "phase" if hooked else "whole run"
    emit_result(result)


def _num(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


if __name__ == "__main__":
    main()
