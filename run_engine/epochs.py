"""What an epoch key in Redis holds (the run queue's, one per shard, and the engine jobs').

Its absence says that Redis lost the data beside it (a flush, a restart without persistence);
``1`` that the reconciler restored that data from PostgreSQL; ``recheck:<s>`` that it restored
it with a grace (runs touched that recently were left to writers maybe still in flight) and reads
everything once more from that time (the clock's seconds) on, to cover what it left
(``systems/reconciler.py``).
"""

from __future__ import annotations

import logging
import math

log = logging.getLogger(__name__)
WHOLE = "1"
_RECHECK = "recheck:"


def epoch_value(recheck_at: float | None) -> str:
    """What to write: restored, and read once more from ``recheck_at`` on (None: no more)."""
    return WHOLE if recheck_at is None else f"{_RECHECK}{recheck_at!r}"


def recheck_time(value: bytes | str, key: str = "") -> float | None:
    """When everything is to be read once more, from an epoch key's value; 0 for none. None for a
    value that is neither of :func:`epoch_value`'s (corrupted, written by hand): it is taken as the
    key's absence, logged, so that the reconciler restores the data beside it and writes the key
    again, as after a loss. (Before, such a value raised, and every reconcile pass failed.)"""
    try:
        text = value.decode() if isinstance(value, bytes) else value
        if text == WHOLE:
            return 0.0
        if text.startswith(_RECHECK):
            at = float(text.removeprefix(_RECHECK))
            if math.isfinite(at):
                return at
    except (UnicodeDecodeError, ValueError):
        pass
    log.error("epoch key %s holds %r, which is not an epoch: taken as lost (Redis's data beside it "
              "is restored from PostgreSQL, and the key written again)", key or "?", value[:100])
    return None
