"""What one request may cost the server every tenant shares: bounded, whatever one tenant has
made (10,000 queues, a huge filter, a dead-letter queue of millions)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from run_engine.engine import TriggerRequest

from .conftest import Harness

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


async def test_listing_queues_reads_their_counts_in_one_round_trip(h: Harness, api: httpx.AsyncClient) -> None:
    """One Redis round trip a queue: 10,000 queues (what an environment may have) took a second of
    the server's event loop a request."""
    names = [f"q{i:02d}" for i in range(30)]
    await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", queue=n) for n in names])
    await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", queue="q07"))
    calls: list[Any] = []
    real = h.engine.queue_counts

    async def counting(env_id: str, queues: Any) -> Any:
        calls.append(list(queues))
        return await real(env_id, queues)

    async def one_each(env_id: str, name: str) -> Any:
        raise AssertionError("a round trip for one queue")

    h.engine.queue_counts = counting  # type: ignore[method-assign]
    h.engine.queue_stats = one_each  # type: ignore[method-assign]
    listed = (await api.get("/api/v1/queues")).json()["data"]
    queued = {q["name"]: q["queued"] for q in listed}
    assert {n: queued[n] for n in names} == {n: 2 if n == "q07" else 1 for n in names}
    assert len(calls) == 1
    page = (await api.get("/api/v1/queues", params={"page": 2, "perPage": 10})).json()
    assert [q["name"] for q in page["data"]] == [q["name"] for q in listed][10:20] and len(calls) == 2


async def test_a_token_list_filter_of_many_tags_is_refused(h: Harness, api: httpx.AsyncClient) -> None:
    """Each tag of the filter is a comparison for each token the list walks: 30,000 of them (what a
    request's head holds) made one request minutes of a shared connection and read slot."""
    many = ",".join(f"t{i}" for i in range(101))
    r = await api.get("/api/v1/waitpoints/tokens", params={"filter[tags]": many})
    assert r.status_code == 400 and "filter[tags]" in r.json()["error"]["message"]
    long = await api.get("/api/v1/waitpoints/tokens", params={"filter[tags]": "x" * 257})
    assert long.status_code == 400
    ok = await api.get("/api/v1/waitpoints/tokens", params={"filter[tags]": ",".join(f"t{i}" for i in range(100))})
    assert ok.status_code == 200 and ok.json()["data"] == []
