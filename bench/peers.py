"""Run-engine against its peers: the same N no-op jobs on the same PostgreSQL and Redis, in alternating rounds.

    python bench/peers.py [--runs 5000] [--rounds 2] [--only pgqueuer,celery] [--skip-install]

Standard library only; run it with any Python 3.11+ (database chores go through the project's .venv, which has
psycopg, as run-engine's own benchmarks do). On first use it makes one virtual environment per peer
under bench/.peers/<peer>/ (ignored by git) with the versions pinned in PINS, and reuses it while it has them.
Each system runs in its own subprocess (its venv's Python; the project's .venv for run-engine), in its own
process group, with a timeout, on its own fresh database (CREATE DATABASE peers_<name>_<random>, dropped
afterwards) or its own empty Redis DB number (FLUSHDB afterwards):

  run-engine in process   bench/lifecycle.py --start-in-dequeue (consumers take runs as the supervisor does: the
                          dequeue starts their attempts): batch mode (--enqueue-first), then concurrent
                          (producers and consumers at once); bench/peers/run_engine_bench.py adds CPU markers
  run-engine over HTTP    bench/http_e2e.py, unchanged: server + supervisor + executors; its full-load phase
  pgqueuer, celery, arq, procrastinate, dbos
                          bench/peers/<peer>_bench.py: warm-up, batch, concurrent and latency phases
                          (see bench/peers/common.py); arq and dbos also run once more with a short poll interval

CPU: around each measured phase the subprocess pauses while this script sums utime+stime (+ reaped children) of
its own process tree (the load generator, worker processes, servers run-engine starts), of the PostgreSQL
postmaster, its auxiliary processes and the backends of the system's own database(s) and of the Redis server,
each server only for the systems that use it, from /proc (bench/peers/cpu.py). "other load" is what the rest of
the machine used meanwhile, in cores: more than a few hundredths means the numbers are disturbed.

Round 1 runs the systems in order, round 2 in reverse order, and so on. Prints a markdown table (jobs/s as
min–max over rounds, CPU ms per job and latencies as medians) and ends with the lines
``ratio to pgqueuer in process: R`` (batch ÷ batch) and ``ratio to celery over http: R`` (concurrent ÷
concurrent: run-engine over HTTP has no batch mode). Results: bench/.peers/last.json.

``--fairness`` runs only the noisy-neighbour comparison: a victim's 100 jobs, 5 ms apart, on the idle
system and behind another tenant's ``--flood`` (20,000) jobs; p99 enqueue → start both times
(run-engine: bench/fairness.py with two environments; a peer: its one queue).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PEERS_DIR = BENCH / "peers"
STATE = BENCH / ".peers"
sys.path.insert(0, str(PEERS_DIR))

from cpu import Scope, Servers, Snapshot, snapshot  # noqa: E402
from services import Postgres, Redis  # noqa: E402

DEFAULT_DB = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"

# Exact versions installed in each peer's venv (the latest of each line when this was written).
PINS: dict[str, list[str]] = {
    "pgqueuer": ["pgqueuer==1.6.0", "asyncpg==0.32.0"],
    "celery": ["celery[redis]==5.7.0", "redis==8.1.0"],
    "arq": ["arq==0.28.0"],
    "procrastinate": ["procrastinate==3.10.0", "psycopg[binary]==3.3.9"],
    "dbos": ["dbos==3.4.0", "psycopg[binary]==3.3.9"],
}


@dataclasses.dataclass(frozen=True)
class System:
    key: str  # what --only takes
    label: str
    venv: str | None  # a PINS key; None: the project's .venv
    script: str
    script_args: tuple[str, ...] = ()
    postgres: bool = False  # gets a fresh database; PostgreSQL's CPU counts (only its database's backends)
    redis: bool = False  # gets an empty Redis DB number; Redis's CPU counts
    env: tuple[tuple[str, str], ...] = ()
    protocol_phases: bool = True  # a peer script with batch/concurrent/latency phases
    scope: Scope | None = None  # what CPU counts, when the system makes its own database (run-engine)
    how: str = ""  # shown when the run itself says nothing (it failed)


# bench/_common.py's fresh_database() names its databases re_bench_<hex>
RUN_ENGINE_SCOPE = Scope(postgres=True, redis=True, databases=("re_bench_",))
SYSTEMS: list[System] = [
    # its consumers dequeue as the supervisor does, asking the dequeue to start the attempts in its own statement
    System("run-engine", "run-engine in process", None, "run_engine_bench.py", ("lifecycle", "--start-in-dequeue"),
           protocol_phases=False, how="bench/lifecycle.py --start-in-dequeue", scope=RUN_ENGINE_SCOPE),
    # the API's default limit of 2000 requests/s per key answers 429 to http_e2e's bursts: off, as bench/chaos.py does
    System("run-engine-http", "run-engine over HTTP", None, "run_engine_bench.py", ("http",), protocol_phases=False,
           env=(("RUN_ENGINE_API_RATE_LIMIT", "0"),), how="bench/http_e2e.py", scope=RUN_ENGINE_SCOPE),
    System("pgqueuer", "pgqueuer", "pgqueuer", "pgqueuer_bench.py", postgres=True, how="in process"),
    System("celery", "celery", "celery", "celery_bench.py", redis=True, how="celery worker processes"),
    System("arq", "arq", "arq", "arq_bench.py", redis=True, how="in process"),
    System("arq-poll10ms", "arq, poll_delay 10 ms", "arq", "arq_bench.py", redis=True,
           env=(("ARQ_POLL_DELAY", "0.01"),), how="in process"),
    System("procrastinate", "procrastinate", "procrastinate", "procrastinate_bench.py", postgres=True,
           how="in process"),
    System("dbos", "dbos", "dbos", "dbos_bench.py", postgres=True, how="in process"),
    System("dbos-poll50ms", "dbos, polling 50 ms", "dbos", "dbos_bench.py", postgres=True,
           env=(("DBOS_POLL_INTERVAL", "0.05"),), how="in process"),
]
MEASURED = ("batch", "concurrent")


def project_python() -> Path:
    venv = ROOT / ".venv" / "bin" / "python"
    return venv if venv.exists() else Path(sys.executable)


def venv_python(peer: str) -> Path:
    return STATE / peer / "bin" / "python"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- install


def _dist(pin: str) -> tuple[str, str]:
    name, ver = pin.split("==")
    return name.split("[")[0], ver


def installed_versions(peer: str) -> dict[str, str | None]:
    names = [_dist(p)[0] for p in PINS[peer]]
    code = ("import json, sys\nfrom importlib import metadata\nout = {}\nfor n in sys.argv[1:]:\n"
            "    try:\n        out[n] = metadata.version(n)\n    except metadata.PackageNotFoundError:\n"
            "        out[n] = None\nprint(json.dumps(out))")
    done = subprocess.run([str(venv_python(peer)), "-c", code, *names], capture_output=True, text=True, timeout=60)
    return dict(json.loads(done.stdout)) if done.returncode == 0 else {}


def ensure_venv(peer: str) -> None:
    """Make bench/.peers/<peer>/ a venv with PINS[peer]; raises RuntimeError when that fails."""
    wanted = dict(_dist(p) for p in PINS[peer])
    if venv_python(peer).exists() and installed_versions(peer) == wanted:
        return
    log(f"installing {peer}: {' '.join(PINS[peer])}")
    STATE.mkdir(parents=True, exist_ok=True)
    logfile = STATE / f"{peer}.install.log"
    with logfile.open("w") as out:
        if not venv_python(peer).exists():
            subprocess.run([sys.executable, "-m", "venv", str(STATE / peer)], check=True, stdout=out, stderr=out,
                           timeout=300)
        done = subprocess.run([str(venv_python(peer)), "-m", "pip", "install", "--disable-pip-version-check",
                               *PINS[peer]], stdout=out, stderr=out, timeout=900)
    if done.returncode != 0:
        tail = logfile.read_text().strip().splitlines()[-1:] or ["?"]
        raise RuntimeError(f"pip install failed ({tail[0][:150]}); see {logfile}")
    got = installed_versions(peer)
    if got != wanted:
        raise RuntimeError(f"installed {got}, wanted {wanted}")


# ---------------------------------------------------------------- one run


@dataclasses.dataclass
class Env:
    postgres: Postgres
    redis: Redis
    servers: Servers


def group_alive(pgid: int) -> bool:
    """Whether any process of the group is still running (zombies left to init do not count)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """End the subprocess's whole process group (its workers, servers, executors): TERM, then KILL."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        proc.poll()  # reap it, if it ended, so that it leaves the group
        if not group_alive(proc.pid):
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            proc.poll()
            if not group_alive(proc.pid):
                return
            time.sleep(0.1)


def _reader(stream: IO[bytes], lines: queue.Queue[str | None]) -> None:
    for raw in iter(stream.readline, b""):
        lines.put(raw.decode(errors="replace").rstrip("\n"))
    lines.put(None)


def run_system(system: System, args: argparse.Namespace, env: Env, round_no: int,
               extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One subprocess of one system; returns its results, or {"error": ...}."""
    out: dict[str, Any] = {"round": round_no}
    python = project_python() if system.venv is None else venv_python(system.venv)
    if not python.exists():
        return {**out, "error": f"no venv at {python.parent.parent}"}
    cmd = [str(python), str(PEERS_DIR / system.script), *system.script_args, "--runs", str(args.runs)]
    if system.protocol_phases:
        cmd += ["--producers", str(args.producers), "--concurrency", str(args.concurrency),
                "--phase-timeout", str(args.timeout), *extra]
    child_env = {**os.environ, "PEERS_PROTOCOL": "1", "PYTHONUNBUFFERED": "1", **dict(system.env)}
    child_env.pop("PYTHONPATH", None)
    db_name, redis_db = None, None
    logdir = STATE / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    logpath = logdir / f"{system.key}-round{round_no}.log"
    try:
        if system.postgres:
            db_name, child_env["DATABASE_URL"] = env.postgres.create(system.key)
        if system.redis:
            redis_db = env.redis.free_db()
            child_env["REDIS_URL"] = env.redis.url_for(redis_db)
        scope = system.scope or Scope(postgres=system.postgres, redis=system.redis,
                                      databases=(db_name,) if db_name else ())
        with logpath.open("w") as logf:
            logf.write(f"$ {shlex.join(cmd)}\n")
            logf.flush()
            out.update(_supervise(cmd, child_env, logf, args.timeout, env.servers, scope))
    except Exception as exc:  # a failure of set-up or clean-up: report it in the row
        out["error"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        if db_name is not None:
            try:
                env.postgres.drop(db_name)
            except Exception as exc:
                log(f"could not drop database {db_name}: {exc}")
        if redis_db is not None:
            try:
                env.redis.flush(redis_db)
            except Exception as exc:
                log(f"could not flush Redis DB {redis_db}: {exc}")
    out["log"] = str(logpath.relative_to(ROOT))
    return out


def _supervise(cmd: list[str], child_env: dict[str, str], logf: IO[str], timeout: float,
               servers: Servers, scope: Scope) -> dict[str, Any]:
    me = os.getpid()
    started = time.monotonic()
    before_all = snapshot(me, servers, scope)
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logf, env=child_env,
                            cwd=ROOT, start_new_session=True)
    assert proc.stdin is not None and proc.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    marks: dict[str, tuple[Snapshot, float]] = {}
    phases: dict[str, dict[str, float]] = {}
    result: dict[str, Any] | None = None
    tail: list[str] = []
    error = None
    try:
        while True:
            left = started + timeout - time.monotonic()
            if left <= 0:
                error = f"timeout after {timeout:.0f} s"
                break
            try:
                line = lines.get(timeout=min(left, 5.0))
            except queue.Empty:
                continue
            if line is None:
                break
            if line.startswith("@@phase "):
                _, event, name = line.split()
                snap, now = snapshot(me, servers, scope), time.monotonic()
                if event == "start":
                    marks[name] = (snap, now)
                elif name in marks:
                    first, t0 = marks.pop(name)
                    phases[name] = {**snap.minus(first), "wall": (now - t0) * 1000}
                proc.stdin.write(b"go\n")
                proc.stdin.flush()
            elif line.startswith("@@result "):
                result = json.loads(line[len("@@result "):])
            else:
                logf.write(line + "\n")
                tail = (tail + [line])[-5:]
    except (BrokenPipeError, OSError) as exc:
        error = f"lost the subprocess: {exc}"
    finally:
        if proc.poll() is None and error is None:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                error = "did not exit after its result"
        kill_group(proc)
        proc.wait()
    after_all = snapshot(me, servers, scope)
    out: dict[str, Any] = {"elapsed_s": time.monotonic() - started, "exit": proc.returncode,
                           "cpu_whole_ms": after_all.minus(before_all), "cpu_phase_ms": phases}
    if result is None:
        out["error"] = error or f"exit {proc.returncode}, no result; last output: {' | '.join(tail)[-200:]}"
        return out
    out.update(result)
    if error and "error" not in out:
        out["error"] = error
    elif proc.returncode not in (0, None) and "error" not in out:
        out["error"] = f"exit {proc.returncode}"
    return out


# ---------------------------------------------------------------- summary


def cpu_per_job(run: dict[str, Any], mode: str) -> float | None:
    """CPU ms per job of a measured phase, or of the whole run when the phase was not marked."""
    phase = run.get("cpu_phase_ms", {}).get(mode)
    if phase and mode in run:
        return float(phase["total"]) / float(run["runs"])
    if mode in run and not run.get("cpu_phase_ms") and run.get("jobs"):
        return float(run["cpu_whole_ms"]["total"]) / float(run["jobs"])
    return None


def other_cores(run: dict[str, Any]) -> float | None:
    """Cores used on average by processes outside the measurement during the measured phases."""
    phases = run.get("cpu_phase_ms") or {}
    other = sum(p["machine"] - p["total"] for p in phases.values())
    wall = sum(p["wall"] for p in phases.values())
    return max(0.0, other / wall) if wall > 0 else None


def _values(runs: list[dict[str, Any]], *path: str) -> list[float]:
    out = []
    for r in runs:
        v: Any = r
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        if isinstance(v, int | float):
            out.append(float(v))
    return out


def summarize(system: System, runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    errors = [r["error"] for r in runs if "error" in r]
    s: dict[str, Any] = {"label": system.label, "key": system.key, "errors": errors,
                         "how": next((r["how"] for r in runs if r.get("how")), system.how)}
    if ok:
        s["version"] = next((r["version"] for r in ok if r.get("version")), None)
    for mode in MEASURED:
        vals = _values(ok, mode, "jobs_s")
        if vals:
            s[mode] = {"min": min(vals), "max": max(vals), "median": statistics.median(vals)}
        cpu = [c for r in ok if (c := cpu_per_job(r, mode)) is not None]
        if cpu:
            s[f"cpu_{mode}"] = statistics.median(cpu)
        s[f"cpu_{mode}_scope"] = "phase" if any(mode in r.get("cpu_phase_ms", {}) for r in ok) else "whole run"
    for q in ("p50_ms", "p99_ms"):
        vals = _values(ok, "latency", q)
        if vals:
            s[q] = statistics.median(vals)
    others = [v for r in ok if (v := other_cores(r)) is not None]
    if others:
        s["other_cores"] = statistics.median(others)
    return s


def _rate(s: dict[str, Any], mode: str) -> str:
    m = s.get(mode)
    if not m:
        return "—"
    lo, hi = round(m["min"]), round(m["max"])
    return f"{lo}" if lo == hi else f"{lo}–{hi}"


def _cpu(s: dict[str, Any]) -> str:
    parts = []
    for mode in MEASURED:
        v = s.get(f"cpu_{mode}")
        mark = "*" if v is not None and s.get(f"cpu_{mode}_scope") == "whole run" else ""
        parts.append("—" if v is None else f"{v:.2f}{mark}")
    return " / ".join(parts)


def table(summaries: list[dict[str, Any]]) -> str:
    head = ("| system | how run | batch jobs/s | concurrent jobs/s | CPU ms/job batch / concurrent "
            "| trigger→start p50 / p99 ms (half load) | other load, cores |")
    rows = [head, "|" + "---|" * 7]
    for s in summaries:
        label = s["label"] + (f" {s['version']}" if s.get("version") else "")
        if "batch" not in s and "concurrent" not in s:
            err = s["errors"][0] if s["errors"] else "no result"
            rows.append(f"| {label} | {s['how']} | failed: {err} | | | | |")
            continue
        lat = (f"{s['p50_ms']:.1f} / {s['p99_ms']:.1f}" if "p50_ms" in s and "p99_ms" in s else "—")
        other = f"{s['other_cores']:.2f}" if "other_cores" in s else "—"
        how = s["how"] + (f" (failed in {len(s['errors'])} round(s): {s['errors'][0]})" if s["errors"] else "")
        rows.append(f"| {label} | {how} | {_rate(s, 'batch')} | {_rate(s, 'concurrent')} | {_cpu(s)} "
                    f"| {lat} | {other} |")
    return "\n".join(rows)


def ratio(num: dict[str, Any] | None, num_mode: str, den: dict[str, Any] | None, den_mode: str) -> str:
    try:
        assert num is not None and den is not None
        return f"{num[num_mode]['median'] / den[den_mode]['median']:.2f}"
    except (AssertionError, KeyError, ZeroDivisionError):
        return "n/a"


# ---------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5000, help="jobs per measured phase (default 5000)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, alternating the order (default 2)")
    parser.add_argument("--only", default="", help="comma-separated systems: " + ",".join(s.key for s in SYSTEMS))
    parser.add_argument("--skip-install", action="store_true", help="use the peers' venvs as they are")
    parser.add_argument("--producers", type=int, default=16, help="concurrent producers in the peers' scripts")
    parser.add_argument("--concurrency", type=int, default=16, help="worker concurrency, where a peer has one")
    parser.add_argument("--fairness", action="store_true",
                        help="only the noisy-neighbour comparison: a victim's p99 under another's flood")
    parser.add_argument("--flood", type=int, default=20_000, help="--fairness: the other tenant's backlog")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per subprocess (default 300 + 0.1 per run)")
    args = parser.parse_args()
    if args.timeout is None:
        args.timeout = 300 + 0.1 * args.runs
    return args


def main() -> None:
    args = parse_args()
    chosen = [s for s in SYSTEMS if not args.only or s.key in args.only.split(",")]
    unknown = set(filter(None, args.only.split(","))) - {s.key for s in SYSTEMS}
    if unknown or not chosen:
        raise SystemExit(f"unknown systems: {', '.join(sorted(unknown)) or '(none chosen)'}; "
                         f"known: {', '.join(s.key for s in SYSTEMS)}")
    database_url = os.environ.get("DATABASE_URL", DEFAULT_DB)
    redis_url = os.environ.get("REDIS_URL", DEFAULT_REDIS)
    command = shlex.join(["python", "bench/peers.py", *sys.argv[1:]])
    started = datetime.now(UTC)

    install_errors: dict[str, str] = {}
    for peer in sorted({s.venv for s in chosen if s.venv}):
        if args.skip_install:
            if not venv_python(peer).exists():
                install_errors[peer] = f"not installed (no {venv_python(peer)}; run without --skip-install)"
            continue
        try:
            ensure_venv(peer)
        except Exception as exc:
            install_errors[peer] = f"install: {exc}"[:300]
            log(f"{peer}: {install_errors[peer]}")

    postgres = Postgres(database_url, project_python())
    redis = Redis(redis_url)
    servers = Servers(postmaster=_try(postgres.postmaster_pid), redis=_try(redis.pid))
    log(f"servers: postmaster pid {servers.postmaster}, redis pid {servers.redis}")
    env = Env(postgres, redis, servers)

    if args.fairness:
        fairness(args, chosen, env)
        return

    results: dict[str, list[dict[str, Any]]] = {s.key: [] for s in chosen}
    for round_no in range(1, args.rounds + 1):
        order = chosen if round_no % 2 == 1 else list(reversed(chosen))
        for system in order:
            if system.venv in install_errors:
                results[system.key].append({"round": round_no, "error": install_errors[system.venv]})
                continue
            log(f"round {round_no}: {system.label} ...")
            run = run_system(system, args, env, round_no)
            results[system.key].append(run)
            log(f"round {round_no}: {system.label}: " + (f"failed: {run['error']}" if "error" in run else
                ", ".join(f"{m} {run[m]['jobs_s']:.0f} jobs/s" for m in MEASURED if m in run)))

    summaries = [summarize(s, results[s.key]) for s in chosen]
    by_key = {s["key"]: s for s in summaries}
    # like for like: batch ÷ batch in process; over HTTP run-engine has only the concurrent mode
    r_pgq = ratio(by_key.get("run-engine"), "batch", by_key.get("pgqueuer"), "batch")
    r_cel = ratio(by_key.get("run-engine-http"), "concurrent", by_key.get("celery"), "concurrent")
    like_pgq = ratio(by_key.get("run-engine"), "concurrent", by_key.get("pgqueuer"), "concurrent")
    like_cel = ratio(by_key.get("run-engine-http"), "concurrent", by_key.get("celery"), "batch")
    record = {"date": started.isoformat(timespec="seconds"), "command": command, "args": vars(args),
              "cores": os.cpu_count(), "pins": PINS, "servers": dataclasses.asdict(servers),
              "summary": summaries, "runs": results,
              "ratios": {"run-engine in process / pgqueuer, batch": r_pgq,
                         "run-engine over HTTP / celery, concurrent": r_cel,
                         "run-engine in process / pgqueuer, concurrent": like_pgq,
                         "run-engine over HTTP (concurrent) / celery batch": like_cel}}
    STATE.mkdir(parents=True, exist_ok=True)
    (STATE / "last.json").write_text(json.dumps(record, indent=2, default=str))

    print(f"date: {started.strftime('%Y-%m-%d %H:%M UTC')}  cores: {os.cpu_count()}  "
          f"commit: {git_commit()}")
    print(f"command: {command}")
    print(f"runs per phase: {args.runs}  rounds: {args.rounds}  producers: {args.producers}  "
          f"worker concurrency: {args.concurrency}")
    print()
    print(table(summaries))
    print()
    print("jobs/s: min–max over rounds; CPU: median over rounds, ms per job summed over the load generator, worker "
          "processes, PostgreSQL (postmaster, auxiliary processes, the backends of the system's databases) and "
          "Redis, each if the system uses it (* = whole run incl. start-up, markers missing); "
          "other load: cores busy with anything else during the measured phases (0 on a quiet machine). "
          "run-engine over HTTP produces and consumes at once: its number is in the concurrent column.")
    print(f"medians; also: run-engine in process ÷ pgqueuer, concurrent {like_pgq}; "
          f"run-engine over HTTP ÷ celery's batch mode {like_cel}. Below: batch ÷ batch in process, "
          "concurrent ÷ concurrent over HTTP.")
    print(f"ratio to pgqueuer in process: {r_pgq}")
    print(f"ratio to celery over http: {r_cel}")


def fairness(args: argparse.Namespace, chosen: list[System], env: Env) -> None:
    """A victim's 100 jobs, 5 ms apart, on the idle system and behind another's flood: run-engine's
    fair queue (bench/fairness.py, two environments, no work per run) against each peer's queue."""
    rows: list[tuple[str, float | None, float | None, str]] = []
    for system in chosen:
        if system.key == "run-engine":
            log("fairness: run-engine in process ...")
            proc = subprocess.run([str(project_python()), str(ROOT / "bench" / "fairness.py"), "--flood",
                                   str(args.flood), "--work-ms", "0", "--only", "tenants"],
                                  capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
            m = re.search(r"^tenants: victim p99 idle ([\d.]+) ms, under a \d+-run flood ([\d.]+) ms",
                          proc.stdout, re.M)
            rows.append((system.label, float(m.group(1)) if m else None, float(m.group(2)) if m else None,
                         "two environments of one worker group" if m else f"failed: {proc.stderr[-200:]}"))
        elif system.protocol_phases:
            log(f"fairness: {system.label} ...")
            run = run_system(system, args, env, 1, ("--modes", "noisy", "--flood", str(args.flood)))
            noisy = run.get("noisy") or {}
            rows.append((system.label, noisy.get("idle_p99_ms"), noisy.get("loaded_p99_ms"),
                         "one queue" if noisy else f"failed: {run.get('error', 'no result')}"))
    print(f"noisy neighbour: a victim's 100 jobs behind another's {args.flood} (p99 enqueue→start, ms)")
    print("| system | idle p99 | under the flood p99 | ratio | |")
    print("| --- | --- | --- | --- | --- |")
    for label, idle, loaded, note in rows:
        ratio_text = f"{loaded / idle:.1f}" if idle and loaded else "—"
        print(f"| {label} | {f'{idle:.1f}' if idle is not None else '—'} | "
              f"{f'{loaded:.1f}' if loaded is not None else '—'} | {ratio_text} | {note} |")


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"
    return (head or "?") + (" + uncommitted changes" if dirty else "")


def _try(fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:
        log(f"{getattr(fn, '__name__', fn)}: {exc}")
        return None


if __name__ == "__main__":
    main()
