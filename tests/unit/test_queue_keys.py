"""Encoded names make every run-queue key unambiguous: no choice of names gives two different
(kind, env, queue, key) the same Redis key."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from run_engine.run_queue.keys import QueueKeys, decode_name, encode_name

NAMES = st.lists(st.sampled_from(["a", "k", "q", "e", "g", "y", "vt", ":", "%", "3", "A", "2", "5", "\x00", "/"]),
                 max_size=6).map("".join)


@given(st.text())
def test_encoding_round_trips_and_has_no_separator(name: str) -> None:
    assert decode_name(encode_name(name)) == name
    assert ":" not in encode_name(name)


@given(st.lists(st.tuples(NAMES, NAMES, NAMES, NAMES), min_size=1, max_size=12))
def test_keys_of_different_things_never_collide(items: list[tuple[str, str, str, str]]) -> None:
    keys = QueueKeys("re:q", shards=1)
    seen: dict[str, tuple[str, ...]] = {}

    def add(key: str, what: tuple[str, ...]) -> None:
        assert seen.setdefault(key, what) == what, (key, what, seen[key])

    for env, queue, ck, wg in items:
        # every kind of key the scripts and the Python side build from these names (queue_lib layout)
        add(keys.env(env) + ":meta", ("env-meta", env))
        add(keys.env(env) + ":running", ("env-running", env))
        add(keys.queue(env, queue) + ":meta", ("queue-meta", env, queue))
        add(keys.queue(env, queue) + ":running", ("queue-running", env, queue))
        add(keys.key(env, queue, ck) + ":running", ("key-running", env, queue, ck))
        ready = keys.ready(env, wg, queue, ck)
        add(ready, ("ready", env, wg, queue, ck))
        group_queue = ready.rsplit(":k:", 1)[0]
        for suffix in ("ks", "heads", "kvz", "kvt", "vt"):
            add(f"{group_queue}:{suffix}", (suffix, env, wg, queue))
        add(keys.message(env, ck or "r"), ("msg", ck or "r"))  # run ids are unique across envs
