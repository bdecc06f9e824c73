"""Random sequences of every queue operation (this version alone) against a model: a run delayed is
in its env's set at its due time with its env indexed at or before it, a ready run in its set, no
run handed out while held or before its due time, and every run waiting is handed out in the end."""

from __future__ import annotations

import random

import pytest
import redis.asyncio as aioredis

from run_engine.run_queue import EnqueueItem, RunQueue
from run_engine.run_queue.models import DeadMessage

NOW = 1_700_000_000_000


def item(run: str, env: str, due: int | None) -> EnqueueItem:
    return EnqueueItem(run_id=run, env_id=env, queue="task/a", worker_group="wg", score_ms=NOW, available_at_ms=due)


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("seed", range(40))
async def test_random_sequences(redis_client: aioredis.Redis, key_prefix: str, unique: str, seed: int,
                                mixed: bool) -> None:
    """mixed: each operation by this version or the version before (a rolling upgrade)."""
    rng = random.Random(seed)
    kw = dict(shards=1, default_env_limit=10_000, promote_limit=rng.choice([1, 2, 3, 500]), max_deliveries=4,
              nack_min_delay_ms=5, nack_max_delay_ms=40, rng=random.Random(seed))
    new = RunQueue(redis_client, prefix=f"{key_prefix}:m{unique}", **kw)  # type: ignore[arg-type]
    await new.load_scripts()
    old = None
    if mixed:
        from tests.integration.test_delayed_rolling_upgrade import _old_run_queue_class, _old_script
        old = _old_run_queue_class()(redis_client, prefix=f"{key_prefix}:m{unique}", **kw)
        for attr in ("_enqueue", "_dequeue", "_ack", "_nack", "_move", "_config", "_restore_dead"):
            setattr(old, attr, _old_script(getattr(new, attr).name))
        await old.load_scripts()
    q = new
    runs = [f"r{i}" for i in range(8)]
    envs = ["envA", "envB", "envC"]
    model: dict[str, tuple[str, str, int]] = {}  # run -> (state, env, due)
    last: dict[str, tuple[int, int]] = {}  # run -> its last delivery (count, held_at)
    now = NOW
    k = q.keys

    async def check(where: str) -> None:
        for run, (state, env, due) in model.items():
            real = (await q.message_states([(env, run)]))[0]
            if state == "delayed" and due <= now and real == "ready":  # promoted
                model[run] = (state := "ready", env, due)
            assert real == state, (where, run, real, state)
            if state == "delayed" and not mixed:
                score = await redis_client.zscore(k.env_delayed(env), run)
                assert score == due, (where, run, score, due)
                idx = await redis_client.zscore(k.delayed_envs(0), env)
                assert idx is not None, (where, run, "env not indexed")
                # at or before its due time, or at the time of the promotion that last served it
                assert idx <= max(due, now), (where, run, idx, due, now)
                assert await redis_client.zscore(k.delayed(0), run) is None
            if state in ("ready", "delayed"):
                assert (await new.placements([(env, run)]))[0] == state, where

    for step in range(120):
        now += rng.choice([0, 0, 1, 3, 10, 25])
        q = old if old is not None and rng.random() < 0.5 else new
        op = rng.choice(["enqueue", "enqueue", "batch", "dequeue", "dequeue", "nack", "release", "remove",
                         "dead_letter", "redrive", "giveback", "reclaim", "ack", "restore_dead"])
        run = rng.choice(runs)
        env = model[run][1] if run in model else rng.choice(envs)
        where = f"seed {seed} step {step} {op} {run}"
        if op in ("enqueue", "batch"):
            picks = [run] if op == "enqueue" else [rng.choice(runs) for _ in range(rng.randint(2, 5))]
            items = []
            for r in picks:
                e = rng.choice(envs)
                due = rng.choice([None, now, now + rng.randint(1, 60)])
                items.append(item(r, e, due))
                d = now if due is None else due
                model[r] = ("delayed" if d > now else "ready", e, d)
            # a run named twice in a batch: the last one holds (an env of each of its earlier entries)
            await q.enqueue(items, now)
        elif op == "dequeue":
            got = await q.dequeue("wg", rng.randint(1, 4), now)
            for m in got:
                st, e, due = model.get(m.run_id, (None, None, 0))
                assert st in ("ready", "delayed") and due <= now, (where, m.run_id, st, due, now)
                model[m.run_id] = ("held", e, due)  # type: ignore[assignment]
                last[m.run_id] = (m.deliveries, int(m.held_at_ms))
        elif run not in model:
            continue
        elif op == "nack":
            res = await q.nack(env, run, now)
            if res.dead_lettered:
                model[run] = ("dlq", env, 0)
            else:
                d = int(res.available_at_ms)  # type: ignore[arg-type]
                model[run] = ("delayed" if d > now else "ready", env, d)
        elif op == "release":
            await q.release(env, run)
            if model[run][0] == "held":
                model[run] = ("released", env, 0)
        elif op == "remove":
            await q.remove(env, run)
            del model[run]
        elif op == "dead_letter":
            await q.dead_letter(env, run, "x", now)
            model[run] = ("dlq", env, 0)
        elif op == "redrive":
            if await q.redrive(env, run, now):
                model[run] = ("ready", env, now)
        elif op == "giveback":
            d = rng.choice([now, now + rng.randint(1, 60)])
            if await q.give_back(env, run, now, d):
                model[run] = ("delayed" if d > now else "ready", env, d)
        elif op == "reclaim":
            if run in last:
                [ok] = await q.reclaim_many([(env, run, *last[run])], now)
                if ok:
                    model[run] = ("held", env, model[run][2])
        elif op == "ack":
            await q.ack([(env, run)])
            del model[run]
        elif op == "restore_dead":
            await q.restore_dead([DeadMessage(item(run, env, None), now, "x", 1)])
        await check(where)

    # in the end every run waiting is handed out, once
    now += 10_000
    q = new
    waiting = {r for r, (st, _, _) in model.items() if st in ("ready", "delayed")}
    seen: set[str] = set()
    for _ in range(200):
        got = await q.dequeue("wg", 3, now)
        ids = {m.run_id for m in got}
        assert not ids & seen
        seen |= ids
        if not got and seen >= waiting:
            break
    assert seen == waiting, (seed, waiting - seen, seen - waiting)
