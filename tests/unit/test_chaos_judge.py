"""The chaos run's verdict counts every kind of violation it promises to catch (so that its
``chaos lost+duplicated: 0`` means something)."""

from __future__ import annotations

from typing import Any

from bench.chaos import Observed, Spec, judge


def spec(i: int, kind: str = "plain", run_id: str | None = None, n: int = 5) -> Spec:
    return Spec(i, kind, n, f"k{i}", {}, run_id=run_id or f"run_{i}")


def run(run_id: str, status: str = "COMPLETED", output: Any = 10) -> dict[str, Any]:
    return {"id": run_id, "status": status, "output": output, "taskIdentifier": "chaos-plain"}


def observed(runs: list[dict[str, Any]], **kw: Any) -> Observed:
    by_id = {r["id"]: r for r in runs}
    base: dict[str, Any] = {"first": by_id, "second": by_id, "ledger": {}, "finished_at": {}, "finished_twice": [],
                            "steps": {}, "slots_held": {}}
    return Observed(**{**base, **kw})


def test_a_clean_run_has_no_violation() -> None:
    ok = observed([run("run_0")], ledger={"run_0": [{"e": "begin", "run": "run_0", "t": 99.0, "tok": "a"}]},
                  finished_at={"run_0": 100.0})
    assert judge([spec(0)], ok).total == 0


def test_each_violation_is_counted() -> None:
    specs = [spec(0), spec(1), spec(2), spec(3), spec(4, "steps"), spec(5)]
    specs[5].error = "idempotency key gave two runs: run_5 run_x"
    runs = [run("run_0", output=11), run("run_2", "EXECUTING"), run("run_3"),
            run("run_4", output=["tokA", "tokB"])]
    o = observed(
        runs,
        first={**{r["id"]: r for r in runs}, "run_3": run("run_3", "CANCELED")},
        ledger={"run_3": [{"e": "begin", "run": "run_3", "t": 200.0, "tok": "x", "attempt": 2}],
                "run_4": [{"e": "step", "run": "run_4", "key": "a", "t": 10.0, "tok": "tokA"},
                          {"e": "step", "run": "run_4", "key": "a", "t": 30.0, "tok": "tokC"},
                          {"e": "step", "run": "run_4", "key": "b", "t": 11.0, "tok": "tokB"}]},
        finished_at={"run_3": 100.0},
        finished_twice=["run_0"],
        steps={("run_4", "a"): ("tokA", 10.5), ("run_4", "b"): ("tokB", 11.5)},
        slots_held={"task/chaos-plain": 1},
    )
    v = judge(specs, o)
    assert any("run_1" in line and "not found" in line for line in v.lost)  # accepted, gone
    assert any(line.startswith("run_2") for line in v.stuck)  # not terminal
    assert any("slots held" in line for line in v.stuck)
    assert any("output 11" in line for line in v.wrong)  # wrong output
    joined = "\n".join(v.duplicated)
    assert "run_0: finished twice" in joined
    assert "run_3: terminal CANCELED became COMPLETED" in joined
    assert "run_3: attempt 2 began" in joined  # an attempt after the run finished
    assert "run_4: step a body ran" in joined  # a journaled step's body after its result was recorded
    assert "idempotency" in joined
    assert v.total == len(v.lost) + len(v.duplicated) + len(v.stuck) + len(v.wrong) >= 9
