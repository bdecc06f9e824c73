"""``--help`` that reads well: a command's one-line summary is its first paragraph on one line
(docstrings wrap in the source, the list of commands must not), and an on/off flag shows no
``<bool>`` type after its name."""

from __future__ import annotations

import inspect
from typing import Any

import typer
from typer.core import TyperOption


def summary(doc: str | None) -> str | None:
    """The first paragraph of a docstring, on one line."""
    if not doc:
        return None
    return " ".join(inspect.cleandoc(doc).split("\n\n", 1)[0].split())


def tidy(app: typer.Typer) -> None:
    """Give every command of ``app`` (and of its groups) a one-line summary; hide flags' types."""
    for command in app.registered_commands:
        if command.short_help is None and command.callback is not None:
            command.short_help = summary(command.help or command.callback.__doc__)
    for group in app.registered_groups:
        if group.typer_instance is not None:
            tidy(group.typer_instance)
    _hide_flag_types()


def _hide_flag_types() -> None:
    if getattr(TyperOption, "_flags_untyped", False):
        return
    shown = TyperOption.display_type_rich

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]
    TyperOption._flags_untyped = True  # type: ignore[attr-defined]
