"""RunQueue: one typed method per Lua script of ``lua/queue_*.lua``.

Every operation is one script call per shard it touches (a batch of runs of many environments
is grouped by shard), and costs O(log n) in the backlog: nothing scans a queue.
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis

from run_engine.epochs import epoch_value, recheck_time
from run_engine.lua_scripts import Call, LuaScript
from run_engine.run_queue.keys import QueueKeys, decode_name, encode_name
from run_engine.run_queue.models import (
    DeadMessage,
    DequeuedMessage,
    DlqEntry,
    EnqueueItem,
    EnvStats,
    Handed,
    NackResult,
    QueueSettings,
    QueueStats,
    RateLimit,
)
from run_engine.run_queue.shard_order import ShardOrder


def _s(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


def _scored(reply: Any) -> list[tuple[bytes | str, float]]:
    """A WITHSCORES reply as (member, score) pairs (redis-py types these replies loosely)."""
    return [(member, float(score)) for member, score in reply]


def _held_rate(t: str | None, tau: str | None, t_us: str | None, tau_us: str | None,
               us_for: str | None) -> str:
    """The rate limit a queue's meta holds, as RateLimit.stored writes it: its µs fields only while
    they go with its ms ones (lua/queue_lib.lua, rate_us_holds): a rate removed or changed by a
    process of the version before, which writes only the ms fields, is the ms one ('' if none)."""
    if t is None:
        return ""
    ms = f"{t},{tau or ''}"
    return f"{ms},{t_us},{tau_us}" if t_us is not None and us_for == ms else ms


def _name(value: bytes | str | None) -> str:
    """A name the scripts hand back (stored encoded: see :mod:`run_engine.run_queue.keys`)."""
    return decode_name(_s(value))


class RunQueue:
    CONFIGURE_CHUNK = 2000  # script calls per pipeline of configure_queues

    def __init__(
        self,
        redis: Redis,
        *,
        prefix: str,
        shards: int = 2,
        max_deliveries: int = 12,
        nack_min_delay_ms: int = 1000,
        nack_max_delay_ms: int = 3_600_000,
        nack_factor: float = 2.0,
        default_env_limit: int = 100,
        promote_limit: int = 500,
        scan_window: int = 32,
        rng: random.Random | None = None,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.keys = QueueKeys(prefix, shards)
        self.max_deliveries = max_deliveries
        self.nack_min_delay_ms = nack_min_delay_ms
        self.nack_max_delay_ms = nack_max_delay_ms
        self.nack_factor = nack_factor
        self.default_env_limit = default_env_limit
        self.promote_limit = promote_limit
        self.scan_window = scan_window
        self._rng = rng or random.Random()
        self._shard_orders: dict[str, ShardOrder] = {}  # worker group -> its order of visiting the shards
        self._enqueue = LuaScript.get("queue_enqueue")
        self._dequeue = LuaScript.get("queue_dequeue")
        self._ack = LuaScript.get("queue_ack")
        self._nack = LuaScript.get("queue_nack")
        self._move = LuaScript.get("queue_move")
        self._config = LuaScript.get("queue_config")
        self._restore_dead = LuaScript.get("queue_restore_dead")

    async def load_scripts(self) -> None:
        for script in (self._enqueue, self._dequeue, self._ack, self._nack, self._move, self._config,
                       self._restore_dead):
            await script.load(self.redis)

    def _shard_args(self, env_id: str) -> tuple[list[str], str]:
        shard = self.keys.shard_of(env_id)
        return [self.keys.delayed(shard)], self.keys.base(shard)

    # --- enqueue / dequeue --------------------------------------------------------------------

    async def enqueue(self, items: Sequence[EnqueueItem], now_ms: int) -> None:
        by_shard: dict[int, list[str | int | float]] = defaultdict(list)
        for it in items:
            due = it.available_at_ms if it.available_at_ms is not None else now_ms
            by_shard[self.keys.shard_of(it.env_id)] += [
                encode_name(it.run_id),
                encode_name(it.env_id),
                encode_name(it.queue),
                encode_name(it.concurrency_key or ""),
                encode_name(it.worker_group),
                it.score_ms,
                due,
                it.task,
                "1" if it.reset_deliveries else "0",
            ]
        await asyncio.gather(
            *(
                self._enqueue(self.redis, [self.keys.delayed(shard)], [self.keys.base(shard), now_ms, *args])
                for shard, args in by_shard.items()
            )
        )

    async def dequeue(self, worker_group: str, max_runs: int, now_ms: int,
                      environments: Sequence[str] = ()) -> Handed:
        """Up to ``max_runs`` runs of ``worker_group`` (only of ``environments`` when given);
        shards are visited in the order of :class:`ShardOrder` (weighted round robin).
        ``retry_at_ms`` of the result says when a rate-limited queue may serve again."""
        out = Handed()
        only: dict[int, list[str]] = defaultdict(list)
        for env_id in environments:
            only[self.keys.shard_of(env_id)].append(encode_name(env_id))
        visit = self._shard_order(worker_group).start() if self.keys.shards > 1 else None
        for shard in visit or (0,):
            if len(out) >= max_runs:
                break
            if environments and shard not in only:
                continue
            flat = await self._dequeue(
                self.redis,
                [self.keys.delayed(shard)],
                [
                    self.keys.base(shard),
                    encode_name(worker_group),
                    now_ms,
                    max_runs - len(out),
                    self.promote_limit,
                    self.default_env_limit,
                    self.scan_window,
                    *only.get(shard, ()),
                ],
            )
            mine, active, rate_next = int(flat.pop()), int(flat.pop()), _s(flat.pop())
            out.backlog = out.backlog or mine > 0
            if visit:
                visit.visited(shard, active, served=len(flat) // 7)
            if rate_next:  # a rate-limited queue was skipped: when it may serve again
                at = int(float(rate_next))
                out.retry_at_ms = at if out.retry_at_ms is None else min(out.retry_at_ms, at)
            for j in range(0, len(flat), 7):
                ck = _name(flat[j + 3])
                out.append(
                    DequeuedMessage(
                        run_id=_name(flat[j]),
                        env_id=_name(flat[j + 1]),
                        queue=_name(flat[j + 2]),
                        concurrency_key=ck or None,
                        worker_group=worker_group,
                        score_ms=float(_s(flat[j + 4])),
                        deliveries=int(flat[j + 5]),
                        task=_s(flat[j + 6]),
                        held_at_ms=int(now_ms),
                    )
                )
        return out

    def _shard_order(self, worker_group: str) -> ShardOrder:
        order = self._shard_orders.get(worker_group)
        if order is None:
            if len(self._shard_orders) > 10_000:  # groups come and go; the weights are only a hint
                self._shard_orders.clear()
            order = self._shard_orders[worker_group] = ShardOrder(self.keys.shards)
        return order

    # --- after a dequeue ------------------------------------------------------------------------

    async def ack(self, items: Sequence[tuple[str, str]], *, held_only: Sequence[bool] = (),
                  deliveries: Sequence[int | None] = (), held_at: Sequence[int | None] = ()) -> None:
        """``(env_id, run_id)`` pairs are done: free their slots and forget them. A run whose
        ``held_only`` is true (by position) is forgotten only if its message is still held by the
        dequeue that handed it out: a suspended run that a continuation enqueued again meanwhile
        keeps that new message. A run with a number in ``deliveries`` (by position) is forgotten
        only if its message is still held by that delivery (a dequeue dropping what it took: the
        run may have been made ready again and handed out since); with its ``held_at`` too (by
        position, the dequeue's ``now_ms``), only if that delivery took it then: a retry, a
        continuation or a redrive resets the count, and a later delivery may have the same one."""
        if held_only and len(held_only) != len(items):
            raise ValueError(f"held_only has {len(held_only)} flags for {len(items)} runs")
        if deliveries and len(deliveries) != len(items):
            raise ValueError(f"deliveries has {len(deliveries)} counts for {len(items)} runs")
        if held_at and len(held_at) != len(items):
            raise ValueError(f"held_at has {len(held_at)} times for {len(items)} runs")
        flags = held_only or [False] * len(items)
        counts = deliveries or [None] * len(items)
        times = held_at or [None] * len(items)
        by_shard: dict[int, list[str]] = defaultdict(list)
        for (env_id, run_id), held, delivery, at in zip(items, flags, counts, times, strict=True):
            only = (f"={delivery}" + (f"@{int(at)}" if at is not None else "") if delivery is not None
                    else "1" if held else "0")
            by_shard[self.keys.shard_of(env_id)] += [encode_name(run_id), only]
        await asyncio.gather(
            *(
                self._ack(self.redis, [self.keys.delayed(shard)], [self.keys.base(shard), *runs])
                for shard, runs in by_shard.items()
            )
        )

    async def nack(self, env_id: str, run_id: str, now_ms: int, retry_at_ms: int | None = None) -> NackResult:
        keys, base = self._shard_args(env_id)
        reply = await self._nack(
            self.redis,
            keys,
            [
                base,
                encode_name(run_id),
                now_ms,
                self.max_deliveries,
                "" if retry_at_ms is None else retry_at_ms,
                self.nack_min_delay_ms,
                self.nack_max_delay_ms,
                self.nack_factor,
                self._rng.random(),
            ],
        )
        if reply[0] == -1:
            return NackResult(dead_lettered=False, deliveries=0, known=False)
        return NackResult(
            dead_lettered=reply[0] == 1,
            deliveries=int(reply[1]),
            available_at_ms=None if reply[0] == 1 else int(reply[2]),
        )

    async def _one(self, action: str, env_id: str, run_id: str, now_ms: int = 0, reason: str = "") -> bool:
        keys, base = self._shard_args(env_id)
        return bool(await self._move(self.redis, keys, [base, action, encode_name(run_id), now_ms, reason]))

    async def release(self, env_id: str, run_id: str) -> None:
        await self._one("release", env_id, run_id)

    async def remove(self, env_id: str, run_id: str) -> bool:
        return await self._one("remove", env_id, run_id)

    async def forget_dead(self, env_id: str, run_id: str) -> bool:
        """Drop a DLQ entry (only if the run is still there: never a run redriven meanwhile)."""
        return await self._one("forget_dead", env_id, run_id)

    async def remove_many(self, items: Sequence[tuple[str, str]]) -> None:
        """Forget ``(env_id, run_id)`` runs wherever the queue holds them (a queue, the DLQ, a slot):
        their rows are being deleted. One pipeline for all."""
        if not items:
            return

        calls: list[Call] = []
        for env_id, run_id in items:
            keys, base = self._shard_args(env_id)
            calls.append((keys, [base, "remove", encode_name(run_id), 0, ""]))
        await self._move.call_many(self.redis, calls)

    async def dead_letter(self, env_id: str, run_id: str, reason: str, now_ms: int) -> None:
        await self._one("dead_letter", env_id, run_id, now_ms, reason)

    async def restore_dead(self, entries: Sequence[DeadMessage]) -> int:
        """Write again the DLQ entries of runs whose messages Redis lost, each in its own
        environment's DLQ; a run whose message is there (in any state) is left as it is. One
        script call per shard, all in one round trip. Returns how many were written."""
        by_shard: dict[int, list[str | int | float]] = defaultdict(list)
        for e in entries:
            it = e.item
            by_shard[self.keys.shard_of(it.env_id)] += [
                encode_name(it.run_id), encode_name(it.env_id), encode_name(it.queue),
                encode_name(it.concurrency_key or ""), encode_name(it.worker_group), it.score_ms, it.task,
                e.dead_at_ms, e.reason, e.deliveries,
            ]
        calls: list[Call] = [([self.keys.delayed(shard)], [self.keys.base(shard), *args])
                             for shard, args in by_shard.items()]
        return sum(int(n) for n in await self._restore_dead.call_many(self.redis, calls))

    async def dlq_rebuild_after(self) -> str | None:
        """The last run id a rebuild of the DLQs has gone through ("": none yet); None: no rebuild
        under way."""
        value = await self.redis.get(self.keys.dlq_rebuild())
        return None if value is None else _s(value)

    async def set_dlq_rebuild_after(self, after: str | None) -> None:
        """Record where the rebuild of the DLQs has got to (None: through, or none)."""
        if after is None:
            await self.redis.delete(self.keys.dlq_rebuild())
        else:
            await self.redis.set(self.keys.dlq_rebuild(), after)

    async def give_back(self, env_id: str, run_id: str, now_ms: int, due_ms: int) -> bool:
        """Put a held run back (ready at ``due_ms``, its place kept, the delivery undone): the
        worker that took it cannot run it."""
        keys, base = self._shard_args(env_id)
        return bool(await self._move(self.redis, keys, [base, "giveback", encode_name(run_id), now_ms, due_ms]))

    async def give_back_many(self, items: Sequence[tuple[str, str]], now_ms: int, due_ms: int) -> list[bool]:
        """:meth:`give_back` for many ``(env_id, run_id)`` runs, in one pipeline: whether each was
        held (a run no longer held, moved on by a cancel or the reconciler meanwhile, is left)."""
        calls: list[Call] = []
        for env_id, run_id in items:
            keys, base = self._shard_args(env_id)
            calls.append((keys, [base, "giveback", encode_name(run_id), now_ms, due_ms]))
        return [bool(x) for x in await self._move.call_many(self.redis, calls)]

    async def reclaim_many(self, deliveries: Sequence[tuple[str, str, int, int]], now_ms: int) -> list[bool]:
        """Take back ``(env_id, run_id, deliveries, held_at_ms)`` deliveries (as
        :class:`DequeuedMessage` has them) of runs written as handed out whose messages were made
        ready again meanwhile (by the reconciler, when their dequeue stalled past its grace
        between its take and its write): held again, their slots taken whatever the limits (the
        runs are handed out). Only a message as its delivery left it (its count and held_at: the
        reconciler keeps both); a run held (by that delivery or a later one), made ready afresh
        (a retry resets the count) or gone is left. One pipeline for all; whether each was
        taken back."""
        calls: list[Call] = []
        for env_id, run_id, count, held_at in deliveries:
            keys, base = self._shard_args(env_id)
            calls.append((keys, [base, "reclaim", encode_name(run_id), now_ms, f"={count}@{held_at}"]))
        return [bool(x) for x in await self._move.call_many(self.redis, calls)]

    async def delivery(self, env_id: str, run_id: str) -> tuple[int, int] | None:
        """The last delivery of a held run (its count and held_at), as :meth:`reclaim_many` takes
        it; None when the run is not held."""
        state, count, held_at = await self.redis.hmget(self.keys.message(env_id, run_id), "state", "deliveries",
                                                       "held_at")
        if _s(state) != "held" or count is None or held_at is None:
            return None
        return int(count), int(float(held_at))

    async def redrive(self, env_id: str, run_id: str, now_ms: int) -> bool:
        return await self._one("redrive", env_id, run_id, now_ms)

    async def list_dlq(self, env_id: str, limit: int = 100, after: str | DlqEntry | None = None) -> list[DlqEntry]:
        """Dead-lettered runs, oldest first. ``after`` is the last entry of the previous page (the
        page goes on from its place even if it left the DLQ meanwhile) or its run id (from the
        start if that run is not in the DLQ any more)."""
        dlq = f"{self.keys.env(env_id)}:dlq"
        entries: list[tuple[bytes | str, float]]
        if after is None:
            entries = _scored(await self.redis.zrange(dlq, 0, limit - 1, withscores=True))
        else:
            if isinstance(after, str):
                score = await self.redis.zscore(dlq, encode_name(after))
                place = None if score is None else (int(score), encode_name(after))
            else:
                place = (after.dead_at_ms, encode_name(after.run_id))
            if place is None:
                entries = _scored(await self.redis.zrange(dlq, 0, limit - 1, withscores=True))
            else:  # the entries that tie with it on time (ordered by member), then the later ones
                ties = _scored(await self.redis.zrangebyscore(dlq, place[0], place[0], withscores=True))
                entries = [(m, sc) for m, sc in ties if _s(m) > place[1]][:limit]
                if len(entries) < limit:
                    entries += _scored(await self.redis.zrangebyscore(dlq, f"({place[0]}", "+inf", start=0,
                                                                      num=limit - len(entries), withscores=True))
        pipe = self.redis.pipeline(transaction=False)
        for run, _ in entries:
            pipe.hmget(self.keys.message(env_id, _name(run)), "queue", "task", "reason", "deliveries")
        fields = await pipe.execute() if entries else []
        return [
            DlqEntry(_name(run), _name(f[0]), _s(f[1]), _s(f[2]), int(score), int(f[3] or 0))
            for (run, score), f in zip(entries, fields, strict=True)
        ]

    # --- limits, pause, stats -------------------------------------------------------------------

    async def _configure(self, op: str, env_id: str, queue: str, value: int | None) -> None:
        keys, base = self._shard_args(env_id)
        await self._config(self.redis, keys, [base, op, encode_name(env_id), encode_name(queue),
                                              "" if value is None else value])

    async def set_env_limit(self, env_id: str, limit: int | None) -> None:
        """Concurrency limit of the environment (None: back to ``default_env_limit``)."""
        await self._configure("env_limit", env_id, "", limit)

    async def set_queue_limit(self, env_id: str, queue: str, limit: int | None) -> None:
        """The queue's concurrency limit, which holds for each of its concurrency keys (runs
        without one are a key of their own), as Trigger.dev's concurrencyLimit (None: only the env
        limit). The version before this one read it as a cap over all keys together."""
        await self._configure("queue_limit", env_id, queue, limit)

    async def set_key_limit(self, env_id: str, queue: str, limit: int | None) -> None:
        """A cap per concurrency key of the queue, when lower than its limit (None: none)."""
        await self._configure("key_limit", env_id, queue, limit)

    async def set_queue_cap(self, env_id: str, queue: str, cap: int | None) -> None:
        """An optional cap over all concurrency keys of the queue together (None: none, the
        default: the env limit is the cap over all)."""
        await self._configure("queue_cap", env_id, queue, cap)

    async def set_rate_limit(self, env_id: str, queue: str, rate: RateLimit | None) -> None:
        """A GCRA rate limit on handing out the queue's runs (None: no rate limit)."""
        keys, base = self._shard_args(env_id)
        value = "" if rate is None else rate.stored()
        await self._config(self.redis, keys, [base, "rate_limit", encode_name(env_id), encode_name(queue), value])

    async def pause(self, env_id: str, queue: str) -> None:
        """Stop handing out the queue's runs (they stay queued; held runs are not affected)."""
        await self._configure("pause", env_id, queue, None)

    async def resume(self, env_id: str, queue: str) -> None:
        await self._configure("resume", env_id, queue, None)

    async def configure_queues(self, settings: Sequence[QueueSettings], *, repair: bool = False) -> list[bool]:
        """Set every setting of each queue (limits, rate limit, paused) as the single-setting
        methods above do, one script call a queue, in pipelined round trips of ``CONFIGURE_CHUNK``.
        A queue whose settings carry a ``version`` keeps those it has when they are newer, or of
        that version (``repair``: only when newer). Whether each queue's settings were set."""
        calls: list[Call] = []
        for s in settings:
            keys, base = self._shard_args(s.env_id)
            *fields, cap = self._settings_fields(s)
            calls.append((keys, [base, "settings", encode_name(s.env_id), encode_name(s.queue),
                                 "" if s.version is None else s.version, *fields, "1" if repair else "0", cap]))
        done: list[bool] = []
        for start in range(0, len(calls), self.CONFIGURE_CHUNK):
            chunk = calls[start:start + self.CONFIGURE_CHUNK]
            done += [bool(x) for x in await self._config.call_many(self.redis, chunk)]
        return done

    @staticmethod
    def _settings_fields(s: QueueSettings) -> list[str]:
        """What the queue's meta holds of ``s``: limit, key_limit, rate (see RateLimit.stored),
        paused ('1'/'0') and cap."""
        return ["" if s.limit is None else str(s.limit), "" if s.key_limit is None else str(s.key_limit),
                "" if s.rate_limit is None else s.rate_limit.stored(),
                "1" if s.paused else "0", "" if s.cap is None else str(s.cap)]

    async def stale_settings(self, settings: Sequence[QueueSettings]) -> list[bool]:
        """Whether each queue's settings in Redis are behind ``settings`` (PostgreSQL's, with their
        version): of an older version (or none), or of this version but unlike them (written by a
        process that knows no versions). One pipelined round trip."""
        if not settings:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for s in settings:
            pipe.hmget(f"{self.keys.queue(s.env_id, s.queue)}:meta", "sv", "limit", "key_limit", "paused", "cap",
                       "rate_t", "rate_tau", "rate_t_us", "rate_tau_us", "rate_us_for")
        stale = []
        for s, (sv, limit, key_limit, paused, cap, *rate_fields) in zip(settings, await pipe.execute(),
                                                                         strict=True):
            have = None if sv is None else int(_s(sv))
            if s.version is None or have is None or have != s.version:
                stale.append(s.version is None or have is None or have < s.version)
                continue
            rate = _held_rate(*(None if x is None else _s(x) for x in rate_fields))
            held = [_s(limit), _s(key_limit), rate, "1" if _s(paused) == "1" else "0", _s(cap)]
            stale.append(held != self._settings_fields(s))
        return stale

    async def queue_stats(self, env_id: str, queue: str) -> QueueStats:
        qk = self.keys.queue(env_id, queue)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hmget(f"{qk}:meta", "queued", "limit", "key_limit", "paused", "cap")
        pipe.scard(f"{qk}:running")
        (queued, limit, key_limit, paused, cap), running = await pipe.execute()
        return QueueStats(
            queued=int(queued or 0),
            running=int(running),
            limit=None if limit is None else int(limit),
            key_limit=None if key_limit is None else int(key_limit),
            paused=_s(paused) == "1",
            cap=None if cap is None else int(cap),
        )

    async def env_stats(self, env_id: str) -> EnvStats:
        ek = self.keys.env(env_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hmget(f"{ek}:meta", "queued", "limit")
        pipe.scard(f"{ek}:running")
        (queued, limit), running = await pipe.execute()
        return EnvStats(
            queued=int(queued or 0),
            running=int(running),
            limit=self.default_env_limit if limit is None else int(limit),
        )

    async def env_counts(self, env_ids: Sequence[str]) -> list[tuple[int, int, int]]:
        """(queued, running, dead-lettered) of each environment, in one pipelined round trip."""
        if not env_ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for env_id in env_ids:
            ek = self.keys.env(env_id)
            pipe.hget(f"{ek}:meta", "queued")
            pipe.scard(f"{ek}:running")
            pipe.zcard(f"{ek}:dlq")
        flat = await pipe.execute()
        return [(max(0, int(flat[i] or 0)), int(flat[i + 1]), int(flat[i + 2])) for i in range(0, len(flat), 3)]

    async def queue_counts(self, queues: Sequence[tuple[str, str]]) -> list[tuple[int, int]]:
        """(queued, running) of each (environment, queue), in one pipelined round trip."""
        if not queues:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for env_id, queue in queues:
            qk = self.keys.queue(env_id, queue)
            pipe.hget(f"{qk}:meta", "queued")
            pipe.scard(f"{qk}:running")
        flat = await pipe.execute()
        return [(max(0, int(flat[i] or 0)), int(flat[i + 1])) for i in range(0, len(flat), 2)]

    async def running_ids(self, env_id: str) -> set[str]:
        return {_name(x) for x in await self.redis.smembers(f"{self.keys.env(env_id)}:running")}

    async def running_counts(self, env_ids: Sequence[str]) -> list[int]:
        """How many runs hold a slot of each environment: one pipelined round trip for all."""
        pipe = self.redis.pipeline(transaction=False)
        for env_id in env_ids:
            pipe.scard(f"{self.keys.env(env_id)}:running")
        return [int(n) for n in await pipe.execute()] if env_ids else []

    async def inspect(self, env_id: str, run_id: str) -> dict[str, object] | None:
        """What the queue knows about a run and what could hold it back (for "explain"): its
        message, the env's and the queue's limits and slots in use, its key's, the queue's pause and
        rate-limit state, and how many runs of its key are ahead of it. None if unknown."""
        msg = {_s(k): _s(v) for k, v in (await self.redis.hgetall(self.keys.message(env_id, run_id))).items()}
        if not msg:
            return None
        for name in ("env", "queue", "ck", "wg"):
            msg[name] = decode_name(msg.get(name, ""))
        ek, qk = self.keys.env(env_id), self.keys.queue(env_id, msg["queue"])
        ck = msg["ck"]
        ready = self.keys.ready(env_id, msg["wg"], msg["queue"], ck)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hget(f"{ek}:meta", "limit")
        pipe.scard(f"{ek}:running")
        pipe.hgetall(f"{qk}:meta")
        pipe.scard(f"{qk}:running")
        pipe.scard(f"{self.keys.key(env_id, msg['queue'], ck)}:running")
        pipe.zrank(ready, encode_name(run_id))
        env_limit, env_running, qmeta, q_running, k_running, ahead = await pipe.execute()
        return {"message": msg, "env_limit": self.default_env_limit if env_limit is None else int(env_limit),
                "env_running": int(env_running), "queue_meta": {_s(k): _s(v) for k, v in qmeta.items()},
                "queue_running": int(q_running), "key_running": int(k_running), "ahead": ahead}

    def _epochs(self) -> list[str]:
        # one per shard, in the shard's slot: on a Redis Cluster, one master that loses its data
        # (and its shards' settings) is seen whichever master held a single key
        return [f"{self.keys.base(shard)}:epoch" for shard in range(self.keys.shards)]

    async def epoch(self) -> float | None:
        """None when Redis lost the queue's data of any shard (a flush, or a restart without
        persistence, of any node): the reconciler then restores settings and runs from PostgreSQL
        and calls :meth:`mark_epoch`; likewise when an epoch key holds what is not an epoch. Else
        when it is to read every run once more (0: never; see :mod:`run_engine.epochs`)."""
        pipe = self.redis.pipeline(transaction=False)
        for key in self._epochs():
            pipe.get(key)
        values = await pipe.execute()
        if any(v is None for v in values):
            return None
        # a value that is not an epoch (corrupted) is taken as lost, and logged
        times = [recheck_time(v, key) for v, key in zip(values, self._epochs(), strict=True)]
        return None if any(t is None for t in times) else max(t for t in times if t is not None)

    async def has_epoch(self) -> bool:
        return await self.epoch() is not None

    async def mark_epoch(self, recheck_at: float | None = None) -> None:
        """The queue is restored; with ``recheck_at``, every run is to be read once more from then on."""
        pipe = self.redis.pipeline(transaction=False)
        for key in self._epochs():
            pipe.set(key, epoch_value(recheck_at))
        await pipe.execute()

    async def message_states(self, items: Sequence[tuple[str, str]]) -> list[str | None]:
        """Each run's message state (``ready``, ``delayed``, ``held``, ``released``, ``dlq``) or None
        when the queue does not know the run."""
        pipe = self.redis.pipeline(transaction=False)
        for env_id, run_id in items:
            pipe.hget(self.keys.message(env_id, run_id), "state")
        return [None if x is None else _s(x) for x in await pipe.execute()] if items else []

    async def placements(self, items: Sequence[tuple[str, str]], *, now_ms: int | None = None,
                         held_grace_ms: float = 0) -> list[str | None]:
        """Like :meth:`message_states`, but ``"lost"`` for a run whose message says ``ready`` or
        ``delayed`` while the run is not in that set (a dequeue that failed half-way, a partial
        flush): the reconciler puts such runs back; ``"broken"`` when the message cannot be read;
        ``"handing out"`` for one held (handed out) less than ``held_grace_ms`` before ``now_ms``:
        its dequeue may still be writing the snapshot. Two pipelined round trips."""
        if not items:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for env_id, run_id in items:
            pipe.hmget(self.keys.message(env_id, run_id), "state", "wg", "queue", "ck", "held_at")
        # one unreadable message (not a hash) must not hide the others: it is reported "broken"
        rows = [[b"broken", None, None, None, None] if isinstance(row, Exception) else row
                for row in await pipe.execute(raise_on_error=False)]
        pipe = self.redis.pipeline(transaction=False)
        checked: list[tuple[int, int]] = []  # (item, how many of the answers are its)
        out: list[str | None] = [None if row[0] is None else _s(row[0]) for row in rows]
        for i, ((env_id, run_id), (state, wg, queue, ck, held_at)) in enumerate(zip(items, rows, strict=True)):
            if _s(state) == "held" and now_ms is not None and held_at is not None \
                    and now_ms - float(held_at) < held_grace_ms:
                out[i] = "handing out"
                continue
            if _s(state) == "ready":
                pipe.zscore(self.keys.ready(env_id, _name(wg), _name(queue), _name(ck)), encode_name(run_id))
                checked.append((i, 1))
            elif _s(state) == "delayed":
                # in its environment's set with the environment indexed (or the promotion never
                # looks), or in the shard's set of the version before
                shard = self.keys.shard_of(env_id)
                pipe.zscore(self.keys.env_delayed(env_id), encode_name(run_id))
                pipe.zscore(self.keys.delayed_envs(shard), encode_name(env_id))
                pipe.zscore(self.keys.delayed(shard), encode_name(run_id))
                checked.append((i, 3))
        if checked:
            answers = iter(await pipe.execute())
            for i, n in checked:
                scores = [next(answers) for _ in range(n)]
                placed = scores[0] is not None if n == 1 else \
                    (scores[0] is not None and scores[1] is not None) or scores[2] is not None
                if not placed:
                    out[i] = "lost"
        return out

    async def has_messages(self, items: Sequence[tuple[str, str]]) -> list[bool]:
        pipe = self.redis.pipeline(transaction=False)
        for env_id, run_id in items:
            pipe.exists(self.keys.message(env_id, run_id))
        return [bool(x) for x in await pipe.execute()] if items else []
