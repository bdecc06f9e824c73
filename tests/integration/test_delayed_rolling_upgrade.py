"""Per-environment delayed sets (0b396f1) in a rolling upgrade: this version's scripts beside the
version before's own (read from the repository's history), on the same keys; and promote's share
with more environments due than the promote limit."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import types
from pathlib import Path

import redis.asyncio as aioredis

from run_engine.lua_scripts import LuaScript
from run_engine.run_queue import EnqueueItem, RunQueue

NOW = 1_700_000_000_000
ROOT = Path(__file__).resolve().parents[2]
BEFORE = "0b396f1~1"  # the version before per-environment delayed sets


def _before(path: str) -> str:
    """A file as the version before had it, from the repository's history (a clone without it,
    `--depth 1`, fails here: these tests run the version before's own scripts beside this one's)."""
    out = subprocess.run(["git", "show", f"{BEFORE}:{path}"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"git show {BEFORE}:{path}: {out.stderr.strip()} (a clone with its history?)"
    return out.stdout


def item(run: str, env: str = "envA", **kw: object) -> EnqueueItem:
    return EnqueueItem(run_id=run, env_id=env, queue="task/a", worker_group="wg", score_ms=NOW, **kw)  # type: ignore[arg-type]


def _old_script(name: str) -> LuaScript:
    s = object.__new__(LuaScript)
    s.name = name
    s.source = _before("lua/queue_lib.lua") + "\n" + _before(f"lua/{name}.lua")
    s.sha = hashlib.sha1(s.source.encode()).hexdigest()
    return s


def _old_run_queue_class() -> type:
    """run_engine/run_queue/queue.py of the version before (`git show 0b396f1~1:...`)."""
    mod = sys.modules.get("_queue_before")
    if mod is None:
        mod = types.ModuleType("_queue_before")
        sys.modules["_queue_before"] = mod
        exec(compile(_before("run_engine/run_queue/queue.py"), "queue_before.py", "exec"), mod.__dict__)
    return mod.RunQueue  # type: ignore[no-any-return]


async def _queues(redis_client: aioredis.Redis, prefix: str, **kw: object) -> tuple[RunQueue, RunQueue]:
    """(this version, the version before) on the same keys."""
    new = RunQueue(redis_client, prefix=prefix, shards=1, default_env_limit=10_000, **kw)  # type: ignore[arg-type]
    old = _old_run_queue_class()(redis_client, prefix=prefix, shards=1, default_env_limit=10_000, **kw)  # type: ignore[arg-type]
    for attr, name in (("_enqueue", "queue_enqueue"), ("_dequeue", "queue_dequeue"), ("_ack", "queue_ack"),
                       ("_nack", "queue_nack"), ("_move", "queue_move"), ("_config", "queue_config"),
                       ("_restore_dead", "queue_restore_dead")):
        setattr(old, attr, _old_script(name))
    await new.load_scripts()
    await old.load_scripts()
    return new, old


async def test_rolling_upgrade_a_run_is_not_handed_out_twice(
        redis_client: aioredis.Redis, key_prefix: str, unique: str) -> None:
    new, old = await _queues(redis_client, f"{key_prefix}:rv{unique}")
    await new.enqueue([item("x", available_at_ms=NOW + 10)], NOW)        # B:e:envA:delayed
    await old.enqueue([item("x", available_at_ms=NOW + 20)], NOW)        # + B:delayed (old detach: no-op)
    await new.enqueue([item("x")], NOW)                                  # detach takes the E entry only
    assert [m.run_id for m in await new.dequeue("wg", 5, NOW + 1)] == ["x"]  # handed out, held
    # the B:delayed entry is left behind; the old promote (no guard) makes the held run ready again
    assert await old.dequeue("wg", 5, NOW + 30) == [], "x handed out a second time"


async def test_rolling_upgrade_a_promotion_from_the_env_set_leaves_no_entry_in_the_shard_set(
        redis_client: aioredis.Redis, key_prefix: str, unique: str) -> None:
    new, old = await _queues(redis_client, f"{key_prefix}:rv{unique}", promote_limit=1)
    await new.enqueue([item("x", available_at_ms=NOW + 10)], NOW)        # B:e:envA:delayed at +10
    await old.enqueue([item("x", available_at_ms=NOW + 20)], NOW)        # + B:delayed at +20, due +20
    await old.enqueue([item("y", env="envB", available_at_ms=NOW + 5)], NOW)  # takes the old loop's limit
    got = await new.dequeue("wg", 5, NOW + 30)  # y from B:delayed, x from its env's set (due +20 <= now)
    assert sorted(m.run_id for m in got) == ["x", "y"]
    assert await old.dequeue("wg", 5, NOW + 31) == [], "x handed out a second time"


async def test_rolling_upgrade_a_run_does_not_run_before_its_due_time(
        redis_client: aioredis.Redis, key_prefix: str, unique: str) -> None:
    new, old = await _queues(redis_client, f"{key_prefix}:rv{unique}")
    await new.enqueue([item("x", available_at_ms=NOW + 10)], NOW)
    await old.enqueue([item("x", available_at_ms=NOW + 20)], NOW)
    await new.enqueue([item("x", available_at_ms=NOW + 60_000)], NOW)    # delayed a minute by this version
    assert await old.dequeue("wg", 5, NOW + 30) == [], "x handed out 59.97 s early"


async def test_more_environments_due_than_the_promote_limit(
        redis_client: aioredis.Redis, key_prefix: str, unique: str) -> None:
    """promote_limit 5: five tenants' retry floods due at once, a sixth tenant's one run due 1 ms later."""
    new, _ = await _queues(redis_client, f"{key_prefix}:rv{unique}", promote_limit=5)
    for env in ("envA", "envB", "envC", "envD", "envE"):
        await new.enqueue([item(f"{env}-{i}", env=env, available_at_ms=NOW + 10) for i in range(40)], NOW)
    await new.enqueue([item("victim", env="envZ", available_at_ms=NOW + 11)], NOW)
    calls = 0
    while True:
        calls += 1
        got = await new.dequeue("wg", 10, NOW + 100)
        if any(m.run_id == "victim" for m in got):
            break
        await new.ack([(m.env_id, m.run_id) for m in got])
        assert calls < 100
    assert calls <= 2, f"the victim came out in dequeue call {calls}"
