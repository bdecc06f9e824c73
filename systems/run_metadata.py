"""Run metadata changed by operations (Trigger.dev's ``metadata.*``, ``metadata.parent.*`` and
``metadata.root.*``): what each operation does is :mod:`run_engine.metadata_ops`; here, which runs
they act on, the bounds of what they make, and the announcement of each change."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import orjson

from run_engine import metadata_ops
from run_engine.db.runs import MetadataRequest, RunRow
from run_engine.dependencies import retry_conflicts
from run_engine.errors import TooLargeError, ValidationError
from run_engine.events import RunEvent
from run_engine.jsontext import stored_size
from run_engine.metadata_ops import MetadataOp
from systems.resources import SystemResources

log = logging.getLogger(__name__)


def _fresh(op: MetadataOp) -> MetadataOp:
    """``op`` with a copy of its value when that is a container: applying operations puts their
    values into the metadata and later ones change them there, in place (a transaction tried
    again must start from the operations as sent)."""
    if not isinstance(op.value, dict | list):
        return op
    try:
        return dataclasses.replace(op, value=orjson.loads(orjson.dumps(op.value)))  # JSON as it came (C speed)
    except (orjson.JSONEncodeError, RecursionError):
        # past 254 levels, an integer past 64 bits, a lone surrogate: a value that cannot be
        # stored as it is (the metadata is written as orjson writes it), used as sent
        return op


class RunMetadataSystem:
    def __init__(self, resources: SystemResources) -> None:
        self.r = resources

    async def change(self, run: RunRow, operations: Sequence[MetadataOp], parent_operations: Sequence[MetadataOp],
                     root_operations: Sequence[MetadataOp], request: tuple[str, str] | None = None) -> dict[str, Any]:
        """Apply ``operations`` to ``run``, ``parent_operations`` to its parent and
        ``root_operations`` to its root (a run without a parent is its own parent and root, as in
        Trigger.dev: its SDK sends ``metadata.parent.*`` of a root run so), in that order, each
        run's under its row lock and all in one transaction: an operation refused while applied
        (``ValidationError``) or a run's metadata past ``max_metadata_bytes`` (``TooLargeError``)
        changes nothing. A parent or root that is gone (retention) is left out. Each run whose
        metadata changed is announced as a replacement is (``run_updated``: realtime streams).
        A transaction PostgreSQL rolls back for a deadlock or a serialization failure (another
        statement locking some of the same rows in another order) is run again, from the
        operations as sent, a few times (``retry_conflicts``). → the run's metadata after them.

        ``request``: the request's idempotency key and the digest of its body. A request the run
        remembers (its key and body, among the last few of the run's) was applied already: it is
        answered with the run's metadata as it is, nothing applied again on any of the runs
        (``ConflictError`` for its key with another body); one it does not is remembered in the
        transaction that applies it (so a request rolled back is not)."""
        ops: dict[str, list[MetadataOp]] = {run.id: []}
        fields: dict[str, list[str]] = {run.id: []}
        for target, given, field in ((run.id, operations, "operations"),
                                     (run.parent_run_id or run.id, parent_operations, "parentOperations"),
                                     (run.root_run_id or run.id, root_operations, "rootOperations")):
            if given:
                ops.setdefault(target, []).extend(given)
                fields.setdefault(target, []).append(field)
        limit = self.r.settings.max_metadata_bytes
        remember = MetadataRequest(run.id, *request) if request is not None else None
        after = await retry_conflicts(lambda: self._change(run, ops, fields, limit, remember), log=log,
                                      what=f"a metadata change of run {run.id}")
        for run_id, (_, written) in after.items():
            if written:
                self.r.events.emit(RunEvent("run_updated", run_id, run.env_id, data={"what": "metadata"}))
        own = after.get(run.id, (None, False))[0]
        return own if isinstance(own, dict) else {}

    async def _change(self, run: RunRow, sent: dict[str, list[MetadataOp]], fields: dict[str, list[str]],
                      limit: int, request: MetadataRequest | None) -> dict[str, tuple[Any, bool]]:
        """One try of :meth:`change`: its transaction, with fresh copies of the operations."""
        ops = {run_id: [_fresh(op) for op in given] for run_id, given in sent.items()}
        budget = metadata_ops.Budget()

        def change(run_id: str, metadata: Any) -> Any:
            field = " + ".join(fields[run_id]) or "operations"
            too_deep = ValidationError(field, f"the run's metadata would be nested more than "
                                              f"{metadata_ops.MAX_DEPTH} levels deep")
            try:
                new, changed = metadata_ops.apply(metadata, ops[run_id], budget)
                if not changed:
                    return None
                # C speed first: what the operations made may be megabytes; as stored (1e+308: 309 digits)
                size = stored_size(orjson.dumps(new), limit)
            except (RecursionError, orjson.JSONEncodeError):  # orjson: past 254 levels
                raise too_deep from None
            if size > limit:
                raise TooLargeError(field, f"the run's metadata would be {size} bytes, more than {limit}")
            if metadata_ops.too_deep(new):
                raise too_deep
            return new

        return await self.r.repo.runs.change_metadata(run.env_id, ops.keys(), change, request=request)
