"""The one producer of run-queue keys. Every key of an environment carries the hash tag of its
shard, ``{rq:N}`` with N = jump-hash(env, shards), so each script touches one cluster slot."""

from __future__ import annotations

import hashlib
from functools import lru_cache


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
        return f"{self.base(shard)}:delayed"

    def message(self, env_id: str, run_id: str) -> str:
        return f"{self.base_for(env_id)}:msg:{run_id}"

    def env(self, env_id: str) -> str:
        return f"{self.base_for(env_id)}:e:{env_id}"

    def queue(self, env_id: str, queue: str) -> str:
        return f"{self.env(env_id)}:q:{queue}"
