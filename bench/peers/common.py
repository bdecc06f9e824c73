"""The harness every peer benchmark under bench/peers/ shares (standard library only: it runs in each peer's venv).

A peer script subclasses `Peer`, then calls `main(peer_factory)`. The script is meant to be started by
`bench/peers.py` (which gives it DATABASE_URL / REDIS_URL of a fresh database and Redis DB), but runs by hand too:

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/somedb bench/.peers/pgqueuer/bin/python \
        bench/peers/pgqueuer_bench.py --runs 2000

Phases, one process, one fresh database:
  warm-up     200 jobs with the worker running (connections, caches, JIT-free Python warm paths)
  batch       enqueue N with the peer's batched enqueue while no worker consumes, then start the worker and
              drain; jobs/s = N / (first enqueue → the N-th job ran)
  concurrent  worker running; `--producers` producers enqueue one job per call until N are enqueued;
              jobs/s = N / (first enqueue → the N-th job ran)
  latency     worker running; N/2 jobs enqueued at half the concurrent rate, the enqueue wall time in the job's
              arguments; the job notes its own start; p50/p99 of start − enqueue
  noisy       (only with --modes noisy) a victim's 100 jobs on the idle system, then after another's 20,000:
              their enqueue → start p99 both times

Protocol with bench/peers.py (only when PEERS_PROTOCOL=1): before and after each measured phase the script
prints ``@@phase start|end <name>`` and waits for one line on stdin, so that the parent can read the CPU
counters of every process while nothing moves; at the end it prints ``@@result <json>``.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

PROTOCOL = os.environ.get("PEERS_PROTOCOL") == "1"
DEFAULT_DB = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
WARMUP = 200


def database_url() -> str:
    return os.environ.get("DATABASE_URL", DEFAULT_DB)


def redis_url() -> str:
    return os.environ.get("REDIS_URL", DEFAULT_REDIS)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def phase_marker(event: str, name: str) -> None:
    """Tell the parent a measured phase starts or ends and wait until it has read the CPU counters."""
    if not PROTOCOL:
        return
    print(f"@@phase {event} {name}", flush=True)
    if not sys.stdin.readline():
        raise SystemExit("parent went away")


def emit_result(result: dict[str, Any]) -> None:
    line = json.dumps(result, separators=(",", ":"))
    print(f"@@result {line}" if PROTOCOL else line, flush=True)


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))
    return values[k]


class Tracker:
    """Counts jobs that ran, from any thread; knows when the N-th one ran and the start latencies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.target = 0
        self.count = 0
        self.t_end = 0.0
        self.latencies: list[float] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Event | None = None

    def reset(self, target: int) -> None:
        with self._lock:
            self.target, self.count, self.t_end, self.latencies = target, 0, 0.0, []
            self._loop = asyncio.get_running_loop()
            self._done = asyncio.Event()

    def hit(self, t_enqueued: float | None = None) -> None:
        """Called by the no-op job; `t_enqueued` is the wall time the producer enqueued it (latency phase)."""
        now = time.time()
        with self._lock:
            self.count += 1
            if t_enqueued is not None:
                self.latencies.append((now - t_enqueued) * 1000)
            if self.count == self.target:
                self.t_end = time.perf_counter()
                if self._loop is not None and self._done is not None:
                    self._loop.call_soon_threadsafe(self._done.set)

    async def wait(self, limit_s: float) -> float:
        """perf_counter() time the target was reached."""
        assert self._done is not None
        try:
            await asyncio.wait_for(self._done.wait(), limit_s)
        except TimeoutError:
            raise TimeoutError(f"{self.count} of {self.target} jobs ran within {limit_s:.0f} s") from None
        return self.t_end


class Peer(abc.ABC):
    """One queue system, driven in process by `run_phases`. Jobs report to `self.tracker`."""

    name = "peer"
    batch_chunk = 1000  # jobs per batched enqueue call

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tracker = Tracker()

    def describe(self) -> dict[str, Any]:
        """How it was run: versions, in process or worker processes, concurrency."""
        return {}

    async def setup(self) -> None:  # noqa: B027 - optional hook
        """Install the schema, open connections."""

    async def teardown(self) -> None:  # noqa: B027 - optional hook
        """Close everything; stop worker processes."""

    @abc.abstractmethod
    async def start_worker(self) -> None:
        """Start consuming jobs (in process or by telling worker processes to consume)."""

    @abc.abstractmethod
    async def stop_worker(self) -> None:
        """Stop consuming."""

    @abc.abstractmethod
    async def enqueue_batch(self, stamps: list[float | None]) -> None:
        """Enqueue len(stamps) jobs with the peer's batched enqueue."""

    @abc.abstractmethod
    async def enqueue_one(self, stamp: float | None) -> None:
        """Enqueue one job."""

    async def reset_tracker(self, target: int) -> None:
        self.tracker.reset(target)

    async def wait_done(self, limit_s: float) -> float:
        """perf_counter() time the N-th job of the phase ran."""
        return await self.tracker.wait(limit_s)

    def latencies(self) -> list[float]:
        return list(self.tracker.latencies)

    async def enqueue_concurrently(self, n: int, producers: int, rate: float | None, stamp: bool) -> None:
        """`producers` producers enqueue one job per call, optionally paced to `rate` jobs/s overall."""
        counter = iter(range(n))
        start = time.time()

        async def producer() -> None:
            for i in counter:
                if rate:
                    delay = start + i / rate - time.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                await self.enqueue_one(time.time() if stamp else None)

        await asyncio.gather(*(producer() for _ in range(producers)))


async def run_phases(peer: Peer, args: argparse.Namespace) -> dict[str, Any]:
    n, limit_s = args.runs, args.phase_timeout
    result: dict[str, Any] = {"runs": n, "producers": args.producers, "jobs": 0}
    await peer.setup()
    try:
        result.update(peer.describe())
        modes = set(args.modes.split(","))
        # warm-up, worker running
        await peer.start_worker()
        await peer.reset_tracker(WARMUP)
        await peer.enqueue_concurrently(WARMUP, args.producers, None, stamp=False)
        await peer.wait_done(limit_s)
        result["jobs"] += WARMUP
        await peer.stop_worker()

        if "batch" in modes:
            await peer.reset_tracker(n)
            phase_marker("start", "batch")
            t0 = time.perf_counter()
            for i in range(0, n, peer.batch_chunk):
                await peer.enqueue_batch([None] * min(peer.batch_chunk, n - i))
            t_enqueued = time.perf_counter()
            await peer.start_worker()
            t_end = await peer.wait_done(limit_s)
            phase_marker("end", "batch")
            result["batch"] = {"jobs_s": n / (t_end - t0), "elapsed_s": t_end - t0, "enqueue_s": t_enqueued - t0}
            result["jobs"] += n
            log(f"{peer.name} batch: {n / (t_end - t0):.0f} jobs/s")
        else:
            await peer.start_worker()

        rate = None
        if "concurrent" in modes:
            await peer.reset_tracker(n)
            phase_marker("start", "concurrent")
            t0 = time.perf_counter()
            await peer.enqueue_concurrently(n, args.producers, None, stamp=False)
            t_enqueued = time.perf_counter()
            t_end = await peer.wait_done(limit_s)
            phase_marker("end", "concurrent")
            rate = n / (t_end - t0)
            result["concurrent"] = {"jobs_s": rate, "elapsed_s": t_end - t0, "enqueue_s": t_enqueued - t0}
            result["jobs"] += n
            log(f"{peer.name} concurrent: {rate:.0f} jobs/s")

        if "latency" in modes and rate:
            m = max(1, n // 2)
            await peer.reset_tracker(m)
            t0 = time.perf_counter()
            await peer.enqueue_concurrently(m, args.producers, rate / 2, stamp=True)
            t_end = await peer.wait_done(limit_s)
            lat = peer.latencies()
            result["latency"] = {"rate": rate / 2, "achieved_jobs_s": m / (t_end - t0), "count": len(lat),
                                 "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99)}
            result["jobs"] += m
            log(f"{peer.name} latency at {rate / 2:.0f}/s: p50 {pct(lat, 50) or 0:.1f} ms, "
                f"p99 {pct(lat, 99) or 0:.1f} ms")
        if "noisy" in modes:
            result["noisy"] = await noisy_neighbour(peer, args)
            result["jobs"] += args.flood + 2 * args.victims
        await peer.stop_worker()
    finally:
        await peer.teardown()
    return result


async def noisy_neighbour(peer: Peer, args: argparse.Namespace) -> dict[str, Any]:
    """Worker running: ``--victims`` jobs, 5 ms apart, on the idle system; then a flood of ``--flood``
    jobs (the peer's batched enqueue: another tenant's backlog) and the victims again. Their
    enqueue→start p99 both times (a FIFO queue serves the victims after the whole flood)."""
    async def victims(extra: int) -> list[float]:
        await peer.reset_tracker(extra + args.victims)
        if extra:
            for i in range(0, extra, peer.batch_chunk):
                await peer.enqueue_batch([None] * min(peer.batch_chunk, extra - i))
            await asyncio.sleep(0.5)  # the flood is being worked on
        for _ in range(args.victims):
            await peer.enqueue_one(time.time())
            await asyncio.sleep(0.005)
        await peer.wait_done(args.phase_timeout)
        return peer.latencies()

    idle = await victims(0)
    loaded = await victims(args.flood)
    out = {"flood": args.flood, "victims": args.victims, "idle_p99_ms": pct(idle, 99), "loaded_p99_ms": pct(loaded, 99)}
    log(f"{peer.name} noisy neighbour: victim p99 idle {out['idle_p99_ms'] or 0:.1f} ms, "
        f"under a {args.flood}-job flood {out['loaded_p99_ms'] or 0:.1f} ms")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5000)
    parser.add_argument("--producers", type=int, default=16, help="concurrent producers (one job per call)")
    parser.add_argument("--concurrency", type=int, default=16, help="worker concurrency, where the peer has one")
    parser.add_argument("--modes", default="batch,concurrent,latency", help="also: noisy")
    parser.add_argument("--flood", type=int, default=20_000, help="noisy: the other tenant's backlog")
    parser.add_argument("--victims", type=int, default=100, help="noisy: the victim's jobs")
    parser.add_argument("--phase-timeout", type=float, default=600.0)
    return parser.parse_args(argv)


def main(factory: Callable[[argparse.Namespace], Peer]) -> None:
    args = parse_args()
    peer = factory(args)
    try:
        result = asyncio.run(run_phases(peer, args))
    except BaseException as exc:  # report, then fail
        traceback.print_exc()
        emit_result({"error": f"{type(exc).__name__}: {exc}"[:300]})
        raise SystemExit(1) from None
    emit_result(result)
