"""``migrations/`` and ``lua/`` ship inside the wheel and are found from an installed package."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_carries_migrations_and_lua(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         str(ROOT)],
        check=True, capture_output=True,
    )
    [wheel] = tmp_path.glob("run_engine-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for sql in (ROOT / "migrations").glob("*.sql"):
        assert f"run_engine/_data/migrations/{sql.name}" in names
    lua = list((ROOT / "lua").glob("*.lua"))
    assert lua, "no Lua scripts found"
    for script in lua:
        assert f"run_engine/_data/lua/{script.name}" in names
    # and an installed copy finds them there
    target = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(target)
    out = subprocess.run(
        [sys.executable, "-c",
         "import run_engine._resources as r; print(r.data_dir('lua')); print(r.data_dir('migrations'))"],
        check=True, capture_output=True, text=True, env={"PYTHONPATH": str(target)}, cwd=tmp_path,
    ).stdout.split()
    assert out == [str(target / "run_engine/_data/lua"), str(target / "run_engine/_data/migrations")]
