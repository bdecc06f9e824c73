"""The API reaches the engine only through its facade (run_engine.engine.RunEngine): no module of
run_engine/api (or the dashboard) imports the storage, queue or systems layers, or reaches into the engine's
resources or systems."""

from __future__ import annotations

import ast
from pathlib import Path

API = Path(__file__).resolve().parents[2] / "run_engine" / "api"
DASHBOARD = API.parent / "dashboard"
BEHIND_THE_FACADE = ("run_engine.db", "run_engine.run_queue", "run_engine.jobs", "run_engine.locking",
                     "run_engine.leader", "systems")
ATTRIBUTES_BEHIND = {"resources", "systems", "repo"}


def test_api_imports_nothing_behind_the_facade() -> None:
    offences = []
    for path in sorted([*API.glob("*.py"), *DASHBOARD.glob("*.py")]):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offences += [f"{path.name}:{node.lineno} imports {n}" for n in names
                         if n == BEHIND_THE_FACADE or n.startswith(tuple(f"{p}" for p in BEHIND_THE_FACADE))]
            if isinstance(node, ast.Attribute) and node.attr in ATTRIBUTES_BEHIND:
                offences.append(f"{path.name}:{node.lineno} reaches .{node.attr}")
    assert offences == []


def test_each_system_is_named_alike_in_the_registry_its_class_and_its_module() -> None:
    """`systems.<field>` is the class `<Field>System` of `systems/<field>.py`."""
    import dataclasses
    import typing

    from systems.registry import Systems

    hints = typing.get_type_hints(Systems)
    for f in dataclasses.fields(Systems):
        cls = hints[f.name]
        assert cls.__module__ == f"systems.{f.name}", (f.name, cls.__module__)
        assert cls.__name__ == "".join(part.title() for part in f.name.split("_")) + "System", (f.name, cls.__name__)


ROOT = API.parents[1]
AGGREGATES = {"runs", "waitpoints", "tenancy", "deployments", "schedules", "maintenance", "bulk_actions", "packets"}


def _sources() -> list[Path]:
    return sorted([*ROOT.joinpath("run_engine").rglob("*.py"), *ROOT.joinpath("systems").glob("*.py")])


def test_storage_is_reached_through_its_aggregates() -> None:
    """``repo.runs.get_run(...)``, never ``repo.get_run(...)``: the repository is a front over one
    repository per aggregate and grows no methods of its own."""
    from run_engine.db.repository import Repository

    own = {name for name in vars(Repository) if not name.startswith("_")}
    assert own == {"open", "close", "ping"}, own
    offences = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            holder = node.value if isinstance(node, ast.Attribute) else None
            named = (holder.attr if isinstance(holder, ast.Attribute) else holder.id if isinstance(holder, ast.Name)
                     else None)
            if isinstance(node, ast.Attribute) and named == "repo" and node.attr not in AGGREGATES | own | {"pool"}:
                offences.append(f"{path.relative_to(ROOT)}:{node.lineno} repo.{node.attr}")
    assert offences == []


def test_no_system_imports_a_private_name_of_another_module() -> None:
    offences = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("systems",
                                                                                                  "run_engine"):
                offences += [f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{a.name}" for a in node.names
                             if a.name.startswith("_")]
    assert offences == []


def test_no_system_calls_a_private_method_of_a_sibling() -> None:
    """``self.enqueue.current_task(...)``, never ``self.enqueue._task(...)``."""
    from systems.registry import Systems

    siblings = {f for f in Systems.__dataclass_fields__}
    offences = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Attribute) and node.value.attr in siblings):
                offences.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value.attr}.{node.attr}")
    assert offences == []


def test_the_sdk_imports_only_pure_modules_of_the_engine() -> None:
    """A task's executor imports the SDK (run_engine/sdk): of the rest of the engine, only pure modules
    (``metadata.*`` applies its changes locally with the server's own run_engine/metadata_ops.py),
    never storage, queue, systems or the API."""
    pure = {"run_engine.metadata_ops", "run_engine.errors", "run_engine.records"}
    offences = []
    for path in sorted(ROOT.joinpath("run_engine", "sdk").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module == "run_engine":
                names = [f"run_engine.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offences += [f"{path.name}:{node.lineno} imports {n}" for n in names
                         if n.split(".")[0] in ("run_engine", "systems", "supervisor")
                         and not n.startswith("run_engine.sdk") and n not in pure]
    assert offences == []
    for module in pure:  # and those import nothing else of it
        tree = ast.parse(ROOT.joinpath(*module.split(".")).with_suffix(".py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert {m for m in imported if m.split(".")[0] in ("run_engine", "systems")} <= pure, module
