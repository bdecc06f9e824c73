"""Limits that protect the service (issue 10): a request rate per credential (429 with
Retry-After) so that one tenant's flood does not reach another's, and caps on the long-lived
requests (realtime streams, long-polls) one credential may hold open."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from .conftest import Stack, start_server, stop

W = "/engine/v1/worker-actions"


@pytest.fixture(scope="module")
def limited(stack: Stack) -> Iterator[str]:
    url, proc = start_server(stack.env, stack.logs / "limited-server.log", RUN_ENGINE_API_RATE_LIMIT="20",
                             RUN_ENGINE_API_RATE_BURST="20", RUN_ENGINE_MAX_STREAMS_PER_KEY="5",
                             RUN_ENGINE_MAX_LONG_POLLS_PER_TOKEN="3")
    yield url
    stop(proc)


def _tenant(stack: Stack, project: str) -> dict[str, str]:
    creds = json.loads(stack.cli("bootstrap", "--org", "e2e", "--project", project, "--env", "dev").stdout)
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {creds['workerGroupToken']}"}) as w:
        assert w.post(f"{W}/connect", json={"workerInstanceName": "x", "deployment": {
            "tasks": [{"id": "t"}]}}).status_code == 200
    return dict(creds)


FLOOD = """
import asyncio, collections, json, sys, time
import httpx

async def main(url, key, seconds):
    counts = collections.Counter()
    retry_after = set()
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        end = time.monotonic() + seconds
        async def one():
            while time.monotonic() < end:
                r = await client.post("/api/v1/tasks/t/trigger", json={"payload": 1},
                                      headers={"Authorization": f"Bearer {key}"})
                counts[r.status_code] += 1
                if r.status_code == 429:
                    retry_after.add(r.headers.get("Retry-After"))
        await asyncio.gather(*(one() for _ in range(16)))
    print(json.dumps({"counts": counts, "retryAfter": sorted(x or "" for x in retry_after)}))

asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
"""


def _latencies(url: str, key: str, n: int) -> tuple[list[int], list[float]]:
    statuses, latencies = [], []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        for i in range(n):  # within the tenant's own budget of 20/s
            t0 = time.monotonic()
            statuses.append(c.post("/api/v1/tasks/t/trigger", json={"payload": i}).status_code)
            latencies.append(time.monotonic() - t0)
            time.sleep(0.07)
    return statuses, latencies


def test_one_tenants_flood_is_limited_and_never_reaches_another(stack: Stack, limited: str) -> None:
    a, b = _tenant(stack, "flood-a"), _tenant(stack, "flood-b")
    _, quiet = _latencies(limited, b["apiKey"], 10)
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, limited, a["apiKey"], "3"], stdout=subprocess.PIPE,
                             text=True)
    time.sleep(0.5)
    statuses, busy = _latencies(limited, b["apiKey"], 15)
    out, _ = flood.communicate(timeout=60)
    result = json.loads(out)
    counts = {int(k): v for k, v in result["counts"].items()}
    assert statuses == [200] * 15  # B's triggers all succeed during A's flood
    assert set(counts) <= {200, 429} and counts[429] > counts.get(200, 0)
    assert result["retryAfter"] and all(int(x) >= 1 for x in result["retryAfter"])
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {a['apiKey']}"}) as c:
        stored = len(c.get("/api/v1/runs", params={"page[size]": "100"}).json()["data"])
    assert stored == min(100, counts.get(200, 0))  # a refused request created nothing
    p50 = lambda xs: sorted(xs)[len(xs) // 2] * 1000  # noqa: E731
    print(f"tenant B trigger p50: {p50(quiet):.1f} ms alone, {p50(busy):.1f} ms during A's flood "
          f"(A: {counts.get(200, 0)} accepted, {counts[429]} limited)")


def test_open_streams_and_long_polls_are_capped_per_credential(stack: Stack, limited: str) -> None:
    a, b = _tenant(stack, "streams-a"), _tenant(stack, "streams-b")

    def run_of(creds: dict[str, str]) -> str:
        with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {creds['apiKey']}"}) as c:
            return str(c.post("/api/v1/tasks/t/trigger", json={"payload": 1}).json()["id"])

    run_a, run_b = run_of(a), run_of(b)

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=limited, timeout=30) as client:
            auth_a = {"Authorization": f"Bearer {a['apiKey']}"}
            opened = []
            for _ in range(5):
                cm = client.stream("GET", f"/realtime/v1/runs/{run_a}", headers=auth_a)
                response = await cm.__aenter__()
                assert response.status_code == 200
                opened.append(cm)
            over = [await client.get(f"/realtime/v1/runs/{run_a}", headers=auth_a) for _ in range(20)]
            assert {r.status_code for r in over} == {429}
            assert over[0].json()["error"]["code"] == "too_many_open" and over[0].headers["Retry-After"] == "1"
            async with client.stream("GET", f"/realtime/v1/runs/{run_b}",
                                     headers={"Authorization": f"Bearer {b['apiKey']}"}) as other:
                assert other.status_code == 200  # another tenant is not affected
            for cm in opened:
                await cm.__aexit__(None, None, None)
            deadline = time.monotonic() + 10  # the server frees the slots as it sees the disconnects
            while (await client.get(f"/api/v1/runs/{run_a}/explain", headers=auth_a)).status_code == 200:
                async with client.stream("GET", f"/realtime/v1/runs/{run_a}", headers=auth_a) as again:
                    if again.status_code == 200:
                        break
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)

            token_a = {"Authorization": f"Bearer {a['workerGroupToken']}"}
            # empty the group's queue first: a long-poll only waits when there is nothing to take
            await client.post(f"{W}/dequeue", json={"maxRuns": 100}, headers=token_a)
            polls = [asyncio.create_task(client.post(f"{W}/dequeue", json={"maxRuns": 1, "waitMs": 3000},
                                                     headers=token_a)) for _ in range(3)]
            await asyncio.sleep(0.5)
            fourth = await client.post(f"{W}/dequeue", json={"maxRuns": 1, "waitMs": 3000}, headers=token_a)
            assert fourth.status_code == 429 and fourth.json()["error"]["code"] == "too_many_open"
            quick = await client.post(f"{W}/dequeue", json={"maxRuns": 1}, headers=token_a)
            assert quick.status_code == 200  # a dequeue that does not wait holds nothing
            assert [p.status_code for p in await asyncio.gather(*polls)] == [200] * 3

    asyncio.run(scenario())
