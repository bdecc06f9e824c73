"""Explain: why has a QUEUED or DELAYED run not started? The reasons come from PostgreSQL (the
run's status, delay, deployment) and from the queue (paused, limits with their numbers, rate limit,
back-off, position)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from run_engine.errors import NotFoundError
from run_engine.statuses import ExecutionStatus
from systems.resources import SystemResources

E = ExecutionStatus


def _at(ms: float) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def _text(when: datetime | None) -> str:
    return when.isoformat().replace("+00:00", "Z") if when else "?"


@dataclass(frozen=True, slots=True)
class Reason:
    """One reason a run has not started: a code, a sentence, and the facts behind it (``until``,
    ``task``, ``queue``, ``running``, ``limit``, ``concurrency_key``, ``ahead``)."""
    code: str
    message: str
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Explanation:
    run_id: str
    status: str
    execution_status: str | None
    reasons: list[Reason]

    @property
    def summary(self) -> str:
        return self.reasons[0].message if self.reasons else ""


class ExplainSystem:
    def __init__(self, resources: SystemResources) -> None:
        self.r = resources

    async def explain(self, env_id: str, run_id: str) -> Explanation:
        run = await self.r.repo.runs.get_run(run_id, env_id)
        if run is None:
            raise NotFoundError("run", run_id)
        latest = await self.r.repo.runs.latest_snapshot(run_id)
        status = latest.engine_status if latest else None
        reasons: list[Reason] = []
        if status == E.DELAYED:
            until = run.delay_until
            reasons.append(Reason("DELAYED", f"delayed: not due until {_text(until)}", {"until": until}))
        elif status == E.PENDING_VERSION:
            reasons.append(Reason("WAITING_FOR_DEPLOYMENT",
                                  f"no deployment of this environment has the task {run.task_id!r} "
                                  "yet: start a supervisor whose tasks include it", {"task": run.task_id}))
        elif status in (E.QUEUED, E.QUEUED_EXECUTING):
            reasons += await self._queued(env_id, run.id)
            if run.locked_to_version is not None and reasons[0].code not in ("DEAD_LETTERED", "BEING_STARTED"):
                reasons = await self._locked(run.worker_group_id, run.env_id, run.task_id, run.locked_to_version,
                                             run.locked_to_deployment_id, reasons)
        else:
            reasons.append(Reason("NOT_WAITING_TO_START",
                                  f"the run is {run.status}: explain is for runs that have not started"))
        return Explanation(run.id, run.status, status, reasons)

    async def _locked(self, worker_group_id: str, env_id: str, task_id: str, version: str,
                      deployment_id: str | None, reasons: list[Reason]) -> list[Reason]:
        """A run locked to a version (lockToVersion) that is not the current one: only a worker of
        that version's deployment takes it, every other gives it back (it is never PENDING_VERSION),
        so it is not READY for any worker that asks (first: a give-back's NOT_DUE is no back-off)."""
        current = await self.r.repo.deployments.current_task(env_id, worker_group_id, task_id)
        if current is not None and current.deployment_id == deployment_id:
            return reasons
        now = f"the current one is {current.version!r}" if current is not None and current.version \
            else "no current deployment has its task"
        lock = Reason("LOCKED_TO_VERSION",
                      f"locked to version {version!r} (lockToVersion), not the current deployment ({now}): "
                      "only a worker of that version takes it; workers of other versions give it back",
                      {"version": version})
        return [lock, *(r for r in reasons if r.code != "READY")]

    async def _queued(self, env_id: str, run_id: str) -> list[Reason]:
        facts = await self.r.queue.inspect(env_id, run_id)
        now = self.r.now_ms()
        if facts is None:
            return [Reason("NOT_IN_QUEUE", "the queue does not hold this run; the reconciler puts it back "
                                           "within a few seconds")]
        msg: dict[str, str] = facts["message"]  # type: ignore[assignment]
        qmeta: dict[str, str] = facts["queue_meta"]  # type: ignore[assignment]
        reasons: list[Reason] = []
        if msg.get("state") == "dlq":
            return [Reason("DEAD_LETTERED", "the run is in the dead-letter queue: redrive it")]
        if msg.get("state") == "held":
            return [Reason("BEING_STARTED", "a worker has just taken the run; it is starting")]
        if msg.get("state") == "delayed" and float(msg.get("due") or 0) > now:
            due = _at(float(msg["due"]))
            reasons.append(Reason("NOT_DUE", f"waiting before its next attempt (back-off): not due until {_text(due)}",
                                  {"until": due}))
        queue = msg["queue"]
        if qmeta.get("paused") == "1":
            reasons.append(Reason("QUEUE_PAUSED", f"the queue {queue!r} is paused", {"queue": queue}))
        env_running, env_limit = facts["env_running"], facts["env_limit"]
        if env_running >= env_limit:  # type: ignore[operator]
            reasons.append(Reason("ENV_AT_LIMIT", f"the environment runs {env_running} of its {env_limit} runs at once",
                                  {"running": env_running, "limit": env_limit}))
        # the queue's limit holds for each concurrency key (runs without one are a key of their own),
        # as lua/queue_dequeue.lua reads it; its optional cap for all its keys together
        ck, key_running = msg.get("ck") or "", facts["key_running"]
        if "limit" in qmeta and key_running >= int(qmeta["limit"]):  # type: ignore[operator]
            whose = (f"runs {key_running} runs of the concurrency key {ck!r}" if ck
                     else f"runs {key_running} runs without a concurrency key")
            reasons.append(Reason("QUEUE_AT_LIMIT", f"the queue {queue!r} {whose}: its limit is {qmeta['limit']} "
                                                    "runs at once for each concurrency key",
                                  {"queue": queue, "running": key_running, "limit": int(qmeta["limit"]),
                                   **({"concurrency_key": ck} if ck else {})}))
        if "cap" in qmeta and facts["queue_running"] >= int(qmeta["cap"]):  # type: ignore[operator]
            reasons.append(Reason("QUEUE_AT_LIMIT", f"the queue {queue!r} runs {facts['queue_running']} of its "
                                                    f"{qmeta['cap']} runs at once (all its keys together)",
                                  {"queue": queue, "running": facts["queue_running"], "limit": int(qmeta["cap"])}))
        if "key_limit" in qmeta and facts["key_running"] >= int(qmeta["key_limit"]):  # type: ignore[operator]
            reasons.append(Reason("KEY_AT_LIMIT", f"the concurrency key {msg.get('ck')!r} runs {facts['key_running']} "
                                                  f"of its {qmeta['key_limit']} runs at once",
                                  {"concurrency_key": msg.get("ck"), "running": facts["key_running"],
                                   "limit": int(qmeta["key_limit"])}))
        if "rate_t" in qmeta:  # as the dequeue reads them (lua/queue_dequeue.lua, queue_lib's rate_us_holds)
            rate_ms = f"{qmeta['rate_t']},{qmeta.get('rate_tau', '')}"
            tau = (float(qmeta.get("rate_tau_us") or 0) / 1000
                   if "rate_t_us" in qmeta and qmeta.get("rate_us_for") == rate_ms
                   else float(qmeta.get("rate_tau") or 0))
            tat = float(qmeta.get("tat") or 0)
            if "tat" in qmeta and "tat_us" in qmeta and tat == float(qmeta["tat_us"]) // 1000:
                tat = float(qmeta["tat_us"]) / 1000
            allowed = max(tat, now) - tau
            if allowed > now:
                until = _at(allowed)
                reasons.append(Reason("RATE_LIMITED", f"the queue {queue!r} is at its rate limit until {_text(until)}",
                                      {"queue": queue, "until": until}))
        if not reasons:
            ahead = facts["ahead"]
            reasons.append(Reason("READY", "ready: it starts as soon as a worker of its group asks for work"
                                           + (f" ({ahead} runs of its queue ahead of it)" if ahead else ""),
                                  {"ahead": ahead}))
        return reasons
