"""The embedded servers after a crash: what a SIGKILL or a power loss left behind, or another
project's servers, must not make the next start fail, hang or use the wrong server."""

from __future__ import annotations

from pathlib import Path

import pytest

from run_engine.embedded import EmbeddedRedis
from run_engine.errors import ConfigurationError


def test_an_embedded_redis_never_uses_another_redis_on_its_port(tmp_path: Path) -> None:
    """The port of the embedded Redis is fixed (6390): a second project's `run-engine dev` found
    it taken by the first one's Redis, whose PONG it took for its own, and shared its queues."""
    first = EmbeddedRedis(tmp_path / "a" / "redis")
    first.start()
    other = EmbeddedRedis(tmp_path / "b" / "redis", port=first.port)
    same = EmbeddedRedis(tmp_path / "a" / "redis", port=first.port)
    try:
        with pytest.raises(ConfigurationError, match=f"port {first.port} is in use by another redis-server"):
            other.start()
        assert same.start() == first.url  # the same data (another command of the same project): shared
        same.stop()
        import redis

        assert redis.Redis.from_url(first.url).ping()  # not stopped by the one that only shared it
    finally:
        other.stop()
        same.stop()
        first.stop()
