"""A process that campaigns for a leader lease and prints what happens (test_leader.py runs two)."""

from __future__ import annotations

import asyncio
import signal
import sys

from run_engine.db.repository import Repository
from run_engine.leader import LeaderLease


async def main(url: str, name: str, ttl_s: float, renew_s: float) -> None:
    repo = await Repository.open(url, min_size=1, max_size=2)
    lease = LeaderLease(repo, name=name, ttl_s=ttl_s, renew_s=renew_s)

    async def duty() -> None:
        print(f"DUTY {lease.holder}", flush=True)

    lease.add_duty("tick", 0.2, duty)
    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    await lease.start()
    print(f"STARTED {lease.holder}", flush=True)
    was = False
    while not stopping.is_set():
        if lease.is_leader and not was:
            print(f"LEADER {lease.holder}", flush=True)
        elif was and not lease.is_leader:
            print(f"FOLLOWER {lease.holder}", flush=True)
        was = lease.is_leader
        try:
            await asyncio.wait_for(stopping.wait(), 0.05)
        except TimeoutError:
            pass
    await lease.stop()
    await repo.close()
    print(f"STOPPED {lease.holder}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])))
