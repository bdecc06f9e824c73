"""Explain: why has a QUEUED or DELAYED run not started? The reasons come from PostgreSQL (the
run's status, delay, deployment) and from the queue (paused, limits with their numbers, rate limit,
back-off, position)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from run_engine.errors import NotFoundError
from run_engine.statuses import ExecutionStatus
from systems.resources import SystemResources

E = ExecutionStatus


def _at(ms: float) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat().replace("+00:00", "Z")


class ExplainSystem:
    def __init__(self, resources: SystemResources) -> None:
        self.r = resources

    async def explain(self, env_id: str, run_id: str) -> dict[str, Any]:
        run = await self.r.repo.get_run(run_id, env_id)
        if run is None:
            raise NotFoundError("run", run_id)
        latest = await self.r.repo.latest_snapshot(run_id)
        status = latest.engine_status if latest else None
        reasons: list[dict[str, Any]] = []
        out = {"id": run.id, "status": run.status, "executionStatus": status, "reasons": reasons}
        if status == E.DELAYED:
            until = run.delay_until.isoformat().replace("+00:00", "Z") if run.delay_until else None
            reasons.append({"code": "DELAYED", "until": until, "message": f"delayed: not due until {until}"})
        elif status == E.PENDING_VERSION:
            reasons.append({"code": "WAITING_FOR_DEPLOYMENT", "task": run.task_identifier,
                            "message": f"no deployment of this environment has the task {run.task_identifier!r} "
                                       "yet: start a supervisor whose tasks include it"})
        elif status in (E.QUEUED, E.QUEUED_EXECUTING):
            reasons += await self._queued(env_id, run.id)
        else:
            reasons.append({"code": "NOT_WAITING_TO_START", "message": f"the run is {run.status}: "
                                                                        "explain is for runs that have not started"})
        out["summary"] = reasons[0]["message"] if reasons else ""
        return out

    async def _queued(self, env_id: str, run_id: str) -> list[dict[str, Any]]:
        facts = await self.r.queue.inspect(env_id, run_id)
        now = self.r.now_ms()
        if facts is None:
            return [{"code": "NOT_IN_QUEUE", "message": "the queue does not hold this run; the reconciler "
                                                        "puts it back within a few seconds"}]
        msg: dict[str, str] = facts["message"]  # type: ignore[assignment]
        qmeta: dict[str, str] = facts["queue_meta"]  # type: ignore[assignment]
        reasons: list[dict[str, Any]] = []
        if msg.get("state") == "dlq":
            return [{"code": "DEAD_LETTERED", "message": "the run is in the dead-letter queue: redrive it"}]
        if msg.get("state") == "held":
            return [{"code": "BEING_STARTED", "message": "a worker has just taken the run; it is starting"}]
        if msg.get("state") == "delayed" and float(msg.get("due") or 0) > now:
            due = float(msg["due"])
            reasons.append({"code": "NOT_DUE", "until": _at(due),
                            "message": f"waiting before its next attempt (back-off): not due until {_at(due)}"})
        queue = msg["queue"]
        if qmeta.get("paused") == "1":
            reasons.append({"code": "QUEUE_PAUSED", "queue": queue, "message": f"the queue {queue!r} is paused"})
        env_running, env_limit = facts["env_running"], facts["env_limit"]
        if env_running >= env_limit:  # type: ignore[operator]
            reasons.append({"code": "ENV_AT_LIMIT", "running": env_running, "limit": env_limit,
                            "message": f"the environment runs {env_running} of its {env_limit} runs at once"})
        if "limit" in qmeta and facts["queue_running"] >= int(qmeta["limit"]):  # type: ignore[operator]
            reasons.append({"code": "QUEUE_AT_LIMIT", "queue": queue, "running": facts["queue_running"],
                            "limit": int(qmeta["limit"]),
                            "message": f"the queue {queue!r} runs {facts['queue_running']} of its "
                                       f"{qmeta['limit']} runs at once"})
        if "key_limit" in qmeta and facts["key_running"] >= int(qmeta["key_limit"]):  # type: ignore[operator]
            reasons.append({"code": "KEY_AT_LIMIT", "concurrencyKey": msg.get("ck"), "running": facts["key_running"],
                            "limit": int(qmeta["key_limit"]),
                            "message": f"the concurrency key {msg.get('ck')!r} runs {facts['key_running']} of its "
                                       f"{qmeta['key_limit']} runs at once"})
        if "rate_t" in qmeta:
            allowed = max(float(qmeta.get("tat") or 0), now) - float(qmeta.get("rate_tau") or 0)
            if allowed > now:
                reasons.append({"code": "RATE_LIMITED", "queue": queue, "until": _at(allowed),
                                "message": f"the queue {queue!r} is at its rate limit until {_at(allowed)}"})
        if not reasons:
            ahead = facts["ahead"]
            reasons.append({"code": "READY", "ahead": ahead,
                            "message": "ready: it starts as soon as a worker of its group asks for work"
                                       + (f" ({ahead} runs of its queue ahead of it)" if ahead else "")})
        return reasons
