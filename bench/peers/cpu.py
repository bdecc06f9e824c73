"""CPU time of every process a benchmark involves, read from /proc (Linux only, standard library only).

`bench/peers.py` takes a `snapshot` before and after each measured phase and reports the difference:

    from cpu import Servers, snapshot
    before = snapshot(os.getpid(), servers)
    ...  # the phase
    used = snapshot(os.getpid(), servers).minus(before)   # milliseconds per group

A process counts with utime + stime + cutime + cstime (fields 14-17 of /proc/<pid>/stat, in clock ticks of
``os.sysconf('SC_CLK_TCK')``). Adding the children's fields makes the difference of two snapshots exact for
children that ended in between, as long as their parent is counted and reaped them: their whole CPU then moves
into the parent's cutime/cstime (a PostgreSQL backend into the postmaster's, a worker process into its pool's).

Groups: ``tree`` — the root process and all its descendants (the load generator, worker processes, servers a
benchmark starts itself); ``postgres`` — the postmaster and all its processes; ``redis`` — the Redis server.
When the servers' pids are unknown (another host or container), processes are matched by name instead
(``postgres``, ``redis-server``). ``machine`` is the busy time of all CPUs from /proc/stat, so that
``machine - total`` tells how much else ran meanwhile (another user's tests, say).

A `Scope` leaves out a server the measured system does not use, and the time in the window of PostgreSQL
backends that serve other databases (told by their command line, ``postgres: [cluster: ]user database
host(port) state``), so that another user's load on the same servers counts less. It cannot leave out: backends
of other databases that ended in the window (their CPU in it moves into the postmaster's cutime), nor other
clients' commands to the one Redis process.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")
SERVER_NAMES = {"postgres": "postgres", "redis-server": "redis"}


@dataclasses.dataclass(frozen=True)
class Servers:
    """The pids of the servers to count; None means: match processes by name."""

    postmaster: int | None = None
    redis: int | None = None


@dataclasses.dataclass(frozen=True)
class Scope:
    """Which servers count; `databases`: count only PostgreSQL backends of databases whose name starts with one
    of these prefixes (the postmaster and its auxiliary processes always count); empty: all backends."""

    postgres: bool = True
    redis: bool = True
    databases: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ProcStat:
    pid: int
    ppid: int
    comm: str
    ticks: int  # utime + stime + cutime + cstime


@dataclasses.dataclass(frozen=True)
class Snapshot:
    ticks: dict[str, int]  # group -> clock ticks
    machine_ticks: int
    foreign: dict[int, int]  # pid -> clock ticks of the PostgreSQL backends out of scope (inside ticks["postgres"])

    def minus(self, before: Snapshot) -> dict[str, float]:
        """Milliseconds per group between `before` and this snapshot, plus ``total`` and ``machine``.

        Backends out of scope are taken out by their own difference, so that one that was already running
        is taken out only for its time in the window."""
        out = {k: (v - before.ticks.get(k, 0)) * TICK_MS for k, v in self.ticks.items()}
        foreign = sum(t - before.foreign.get(pid, 0) for pid, t in self.foreign.items())
        out["postgres"] = out.get("postgres", 0.0) - foreign * TICK_MS
        out["total"] = sum(out.values())
        out["machine"] = (self.machine_ticks - before.machine_ticks) * TICK_MS
        return out


def read_stat(pid: int) -> ProcStat | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:  # gone, or not ours to read
        return None
    # the command name is in parentheses and may itself contain spaces or parentheses
    comm = raw[raw.index("(") + 1: raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2:].split()
    # fields[0] is field 3 (state): utime..cstime are fields 14..17
    ticks = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
    return ProcStat(pid=pid, ppid=int(fields[1]), comm=comm, ticks=ticks)


def all_processes() -> list[ProcStat]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = read_stat(int(name))
            if st is not None:
                out.append(st)
    return out


def descendants(procs: Iterable[ProcStat], root: int) -> set[int]:
    """`root` and every process below it."""
    children: dict[int, list[int]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p.pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


def backend_database(pid: int) -> str | None:
    """The database a PostgreSQL backend serves, from its command line; None for the postmaster, auxiliary
    processes (checkpointer, walwriter, autovacuum, ...) and what cannot be read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    if not cmd.startswith("postgres: "):
        return None
    words = cmd.removeprefix("postgres: ").split()
    if words and words[0].endswith(":"):  # cluster_name
        words = words[1:]
    # a backend: user database host(port)|[local] state...
    if len(words) >= 3 and (words[2].endswith(")") or words[2] == "[local]"):
        return words[1]
    return None


def machine_busy_ticks() -> int:
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)  # idle + iowait
    return sum(parts[:8]) - idle  # user nice system idle iowait irq softirq steal; guest is inside user


def snapshot(root: int, servers: Servers, scope: Scope | None = None) -> Snapshot:
    """Clock ticks used so far by the process tree at `root`, by PostgreSQL and by Redis."""
    scope = scope or Scope()
    procs = all_processes()
    by_pid = {p.pid: p for p in procs}
    groups: dict[str, set[int]] = {"tree": descendants(procs, root), "postgres": set(), "redis": set()}
    if servers.postmaster is not None and servers.postmaster in by_pid:
        groups["postgres"] = descendants(procs, servers.postmaster)
    else:
        groups["postgres"] = {p.pid for p in procs if p.comm == "postgres"}
    if servers.redis is not None and servers.redis in by_pid:
        groups["redis"] = {servers.redis}
    else:
        groups["redis"] = {p.pid for p in procs if p.comm == "redis-server"}
    groups["postgres"] -= groups["tree"]
    groups["redis"] -= groups["tree"] | groups["postgres"]
    foreign: dict[int, int] = {}
    if not scope.postgres:
        groups["postgres"] = set()
    elif scope.databases:
        for pid in groups["postgres"]:
            db = backend_database(pid)
            if db is not None and not db.startswith(scope.databases) and pid in by_pid:
                foreign[pid] = by_pid[pid].ticks
    if not scope.redis:
        groups["redis"] = set()
    ticks = {g: sum(by_pid[pid].ticks for pid in pids if pid in by_pid) for g, pids in groups.items()}
    return Snapshot(ticks=ticks, machine_ticks=machine_busy_ticks(), foreign=foreign)
