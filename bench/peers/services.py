"""PostgreSQL and Redis chores of bench/peers.py (standard library only).

- fresh databases: CREATE DATABASE peers_<name>_<random> / DROP DATABASE ... WITH (FORCE), run through a Python
  that has psycopg (the project's venv), since the standard library has no PostgreSQL client;
- Redis: a minimal RESP client to find an empty DB number for a peer and FLUSHDB it afterwards;
- the servers' pids, so that bench/peers/cpu.py counts exactly their processes.
"""

from __future__ import annotations

import io
import json
import secrets
import socket
import subprocess
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

_PG_SCRIPT = r"""
import json, sys
import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
base, action, name = sys.argv[1:4]
admin = make_conninfo(**{**conninfo_to_dict(base), "dbname": "postgres"})
with psycopg.connect(admin, autocommit=True) as conn:
    if action == "create":
        conn.execute(f'CREATE DATABASE "{name}"')
    elif action == "drop":
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    elif action == "list":
        print(json.dumps([r[0] for r in conn.execute("SELECT datname FROM pg_database WHERE datname LIKE %s",
                                                      (name + "%",))]))
    elif action == "pid":
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        try:
            stat = open(f"/proc/{pid}/stat").read()
            print(json.dumps(int(stat[stat.rindex(")") + 2:].split()[1])))
        except OSError:
            print(json.dumps(None))
"""


class Postgres:
    def __init__(self, base_url: str, python: Path) -> None:
        self.base_url, self.python = base_url, python

    def _run(self, action: str, name: str = "") -> str:
        out = subprocess.run([str(self.python), "-c", _PG_SCRIPT, self.base_url, action, name],
                             capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"postgres {action} {name}: {out.stderr.strip().splitlines()[-1:]}")
        return out.stdout

    def create(self, peer: str) -> tuple[str, str]:
        """A new empty database; returns (name, url)."""
        name = f"peers_{peer.replace('-', '_')}_{secrets.token_hex(3)}"
        self._run("create", name)
        return name, self.url_for(name)

    def drop(self, name: str) -> None:
        self._run("drop", name)

    def leftovers(self) -> list[str]:
        return list(json.loads(self._run("list", "peers_") or "[]"))

    def postmaster_pid(self) -> int | None:
        value = json.loads(self._run("pid") or "null")
        return int(value) if value else None

    def url_for(self, dbname: str) -> str:
        """The base URL with another database name (URL or key=value conninfo)."""
        if "://" in self.base_url:
            parts = urlsplit(self.base_url)
            return urlunsplit((parts.scheme, parts.netloc, "/" + dbname, parts.query, parts.fragment))
        kept = [kv for kv in self.base_url.split() if not kv.startswith("dbname=")]
        return " ".join([*kept, f"dbname={dbname}"])


class Redis:
    """Just enough of RESP2 for DBSIZE, FLUSHDB and INFO."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.url = url
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 6379
        self.password = unquote(parts.password) if parts.password else None
        self.username = unquote(parts.username) if parts.username else None
        self.db = int(parts.path.lstrip("/") or 0)

    def command(self, db: int, *args: str) -> object:
        with socket.create_connection((self.host, self.port), timeout=10) as sock:
            f = sock.makefile("rwb")
            if self.password:
                self._send(f, "AUTH", *([self.username] if self.username else []), self.password)
            self._send(f, "SELECT", str(db))
            return self._send(f, *args)

    def _send(self, f: io.BufferedRWPair, *args: str) -> object:
        payload = f"*{len(args)}\r\n" + "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
        f.write(payload.encode())
        f.flush()
        return self._read(f)

    def _read(self, f: io.BufferedRWPair) -> object:
        line = f.readline().rstrip(b"\r\n")
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RuntimeError(f"redis: {rest.decode()}")
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else f.read(n + 2)[:-2].decode()
        if kind == b"*":
            return [self._read(f) for _ in range(int(rest))]
        raise RuntimeError(f"redis: unexpected reply {line!r}")

    def free_db(self) -> int:
        """An empty DB number other than the base URL's, from 15 down."""
        for db in range(15, 0, -1):
            if db == self.db:
                continue
            try:
                if self.command(db, "DBSIZE") == 0:
                    return db
            except RuntimeError:  # fewer databases configured
                continue
        raise RuntimeError("no empty Redis database among 1-15")

    def url_for(self, db: int) -> str:
        parts = urlsplit(self.url)
        return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, parts.fragment))

    def flush(self, db: int) -> None:
        self.command(db, "FLUSHDB")

    def pid(self) -> int | None:
        info = self.command(self.db, "INFO", "server")
        for line in str(info).splitlines():
            if line.startswith("process_id:"):
                return int(line.split(":", 1)[1])
        return None
