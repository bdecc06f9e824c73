"""The API reaches the engine only through its facade (run_engine.engine.RunEngine): no module of
run_engine/api imports the storage, queue or systems layers, or reaches into the engine's
resources or systems."""

from __future__ import annotations

import ast
from pathlib import Path

API = Path(__file__).resolve().parents[2] / "run_engine" / "api"
BEHIND_THE_FACADE = ("run_engine.db", "run_engine.run_queue", "run_engine.jobs", "run_engine.locking",
                     "run_engine.leader", "systems")
ATTRIBUTES_BEHIND = {"resources", "systems", "repo"}


def test_api_imports_nothing_behind_the_facade() -> None:
    offences = []
    for path in sorted(API.glob("*.py")):
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
