"""What an epoch key in Redis holds (the run queue's, one per shard, and the engine jobs').

Its absence says that Redis lost the data beside it (a flush, a restart without persistence);
``1`` that the reconciler restored that data from PostgreSQL; ``recheck:<s>`` that it restored
it with a grace (runs touched that recently were left to writers maybe still in flight) and reads
everything once more from that time (the clock's seconds) on, to cover what it left
(``systems/reconciler.py``).
"""

from __future__ import annotations

WHOLE = "1"
_RECHECK = "recheck:"


def epoch_value(recheck_at: float | None) -> str:
    """What to write: restored, and read once more from ``recheck_at`` on (None: no more)."""
    return WHOLE if recheck_at is None else f"{_RECHECK}{recheck_at!r}"


def recheck_time(value: bytes | str) -> float:
    """When everything is to be read once more, from an epoch key's value; 0 for none."""
    text = value.decode() if isinstance(value, bytes) else value
    return float(text.removeprefix(_RECHECK)) if text.startswith(_RECHECK) else 0.0
