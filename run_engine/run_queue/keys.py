"""The one producer of run-queue keys. Every key of an environment carries the hash tag of its
shard, ``{rq:N}`` with N = jump-hash(env, shards), so each script touches one cluster slot.

Names chosen by users (queue names, concurrency keys; environment and worker-group ids too,
though we make those) are **encoded** before they become part of a key: ``%`` → ``%25``, ``:`` →
``%3A``, NUL → ``%00``. An encoded name never contains the ``:`` that separates the parts of a
key, so each key maps back to exactly one (kind, env, queue, key) and no name can make one tenant's
key another key's kind or another tenant's key. The Lua scripts only ever see encoded names (the
message hash stores them encoded); :class:`RunQueue` decodes what it hands back.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache

_ESCAPES = {"%": "%25", ":": "%3A", "\x00": "%00"}
_UNESCAPES = {v: k for k, v in _ESCAPES.items()}
_ESCAPED = re.compile("%25|%3A|%00")


def encode_name(name: str) -> str:
    """``name`` as it may appear inside a key (injective, no ``:``)."""
    if "%" not in name and ":" not in name and "\x00" not in name:
        return name  # the usual case costs three scans
    return "".join(_ESCAPES.get(c, c) for c in name)


def decode_name(encoded: str) -> str:
    if "%" not in encoded:
        return encoded
    return _ESCAPED.sub(lambda m: _UNESCAPES[m.group(0)], encoded)


def jump_hash(key: int, buckets: int) -> int:
    """Lamping & Veach's jump consistent hash: a bucket in [0, buckets)."""
    b, j = -1, 0
    while j < buckets:
        b = j
        key = (key * 2862933555777941757 + 1) & 0xFFFFFFFFFFFFFFFF
        j = int((b + 1) * (float(1 << 31) / float((key >> 33) + 1)))
    return b


class QueueKeys:
    def __init__(self, prefix: str, shards: int) -> None:
        if shards < 1:
            raise ValueError("shards must be >= 1")
        if "{" in prefix or "}" in prefix:
            raise ValueError("the key prefix must not contain braces (they are the hash tag)")
        self.prefix = prefix
        self.shards = shards
        self._shard = lru_cache(maxsize=65536)(self._compute_shard)

    def _compute_shard(self, env_id: str) -> int:
        digest = hashlib.blake2b(env_id.encode(), digest_size=8).digest()
        return jump_hash(int.from_bytes(digest, "big"), self.shards)

    def shard_of(self, env_id: str) -> int:
        return self._shard(env_id)

    def base(self, shard: int) -> str:
        return f"{self.prefix}:{{rq:{shard}}}"

    def base_for(self, env_id: str) -> str:
        return self.base(self.shard_of(env_id))

    def delayed(self, shard: int) -> str:
        """The shard's one delayed set of the version before (each environment has its own now, see
        :meth:`env_delayed`); every script call still names it: it declares the shard's slot."""
        return f"{self.base(shard)}:delayed"

    def delayed_envs(self, shard: int) -> str:
        """The shard's index of environments with delayed runs (env → earliest due ms)."""
        return f"{self.base(shard)}:delayed_envs"

    def env_delayed(self, env_id: str) -> str:
        """An environment's runs not yet due (run → due ms)."""
        return f"{self.env(env_id)}:delayed"

    def dlq_rebuild(self) -> str:
        """Where the reconciler's rebuild of the DLQs after a loss of Redis's data has got to (one
        key, in shard 0's slot: lost with it, a rebuild starts over, as it must)."""
        return f"{self.base(0)}:dlq_rebuild"

    def message(self, env_id: str, run_id: str) -> str:
        return f"{self.base_for(env_id)}:msg:{encode_name(run_id)}"

    def env(self, env_id: str) -> str:
        return f"{self.base_for(env_id)}:e:{encode_name(env_id)}"

    def queue(self, env_id: str, queue: str) -> str:
        return f"{self.env(env_id)}:q:{encode_name(queue)}"

    def key(self, env_id: str, queue: str, concurrency_key: str | None) -> str:
        """The slot set prefix of one concurrency key (``""`` without a key)."""
        return f"{self.queue(env_id, queue)}:k:{encode_name(concurrency_key or '')}"

    def ready(self, env_id: str, worker_group: str, queue: str, concurrency_key: str | None) -> str:
        """The ready set of one concurrency key of a queue in a worker group's index."""
        return (f"{self.base_for(env_id)}:g:{encode_name(worker_group)}:e:{encode_name(env_id)}"
                f":q:{encode_name(queue)}:k:{encode_name(concurrency_key or '')}")
