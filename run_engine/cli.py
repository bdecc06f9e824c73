"""``run-engine``: the command line."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer

from run_engine.db.migrations import migrate_sync
from run_engine.services import services

app = typer.Typer(help="run-engine: trigger, queue and run background tasks.", no_args_is_help=True)


@app.callback()
def _root() -> None:
    """run-engine: trigger, queue and run background tasks."""


@app.command()
def migrate(
    data_dir: Annotated[Path | None, typer.Option(help="Where embedded servers keep their data (default .run-engine/).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Apply pending database migrations (idempotent; safe when several processes start at once)."""
    with services(data_dir) as svc:
        applied = migrate_sync(svc.database_url)
    if as_json:
        typer.echo(json.dumps({"applied": applied}))
    elif applied:
        typer.echo(f"applied migrations: {', '.join(applied)}")
    else:
        typer.echo("database is up to date")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()
