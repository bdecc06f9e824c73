"""Answers nobody reads: the server aborts a connection whose unsent bytes stop going out.

An answer is written to its connection whole (uvicorn buffers what the socket does not take), so a
client that asks for a large answer (a page of runs with megabyte payloads, a shape of 8 MiB) and
never reads it holds that memory of the server for as long as it keeps the connection open: 100
such connections held 800 MB of one server process, and nothing bounded them by count or per
tenant. The server's protocol (run_engine/server.py) tells :data:`STALLS` when a connection's write
buffer passes its high-water mark and when it drains; a check every ``CHECK_S`` aborts a
connection whose buffer has not shrunk for ``STALL_S``, and, beyond ``STALLED_PER_KEY`` connections
of one credential's environment stalled at once (``CHECK_S`` without progress), those stalled the
longest. A client that reads, however slowly, is never cut; one that stopped reading gives the
memory back within ``STALL_S``, and one tenant holds at most ``STALLED_PER_KEY`` answers' worth.
"""

from __future__ import annotations

import fcntl
import logging
import termios
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from run_engine.api.sweeps import PeriodicSweep

log = logging.getLogger(__name__)

#: a connection whose unsent bytes have not shrunk for this long is aborted
STALL_S = 30.0
#: how often the stalled connections are looked at (and a connection counts as stalled after it)
CHECK_S = 5.0
#: connections of one environment's credentials stalled at once, kept at most
STALLED_PER_KEY = 8
#: where a request's handler leaves the key its credential counts under (``request.state``)
STATE_KEY = "stall_key"


def unsent(transport: Any) -> int:
    """Bytes of the answer not yet taken by the client: the transport's buffer and the kernel's send
    queue (which takes megabytes, and is refilled only when a third of it is free: the buffer alone
    seemed stalled for a minute while a slow client read)."""
    size: int = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            size += int.from_bytes(fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"), "little")
        except (OSError, ValueError):
            pass  # closed meanwhile, or not a socket that tells
    return size


class StallGuard(PeriodicSweep):
    WHAT = "stalled connections"

    def __init__(self, *, stall_s: float = STALL_S, check_s: float = CHECK_S, per_key: int = STALLED_PER_KEY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(check_s)
        self.stall_s = stall_s
        self.per_key = per_key
        self.clock = clock
        # transport -> [key, unsent bytes when last seen to shrink, since when]
        self._watched: dict[Any, list[Any]] = {}

    def __len__(self) -> int:
        return len(self._watched)

    def watch(self, transport: Any, key: str | None) -> None:
        """``transport``'s buffer passed its high-water mark (its answer counts under ``key``)."""
        if transport not in self._watched:
            self._watched[transport] = [key, unsent(transport), self.clock()]
        self._arm()

    def unwatch(self, transport: Any) -> None:
        self._watched.pop(transport, None)

    def sweep(self) -> list[Any]:
        """Abort the connections stalled too long, or beyond their key's share; returns them."""
        now = self.clock()
        out: list[Any] = []
        stalled: dict[str, list[tuple[float, Any]]] = defaultdict(list)
        for transport, entry in list(self._watched.items()):
            if transport.is_closing() and transport.get_write_buffer_size() == 0:
                # aborted, or closed with nothing left to send (a close flushes first: an answer
                # closed after it was written, as every one with `connection: close` is, still
                # holds its unsent bytes until they go out or the connection is aborted)
                del self._watched[transport]
                continue
            size = unsent(transport)
            if size < entry[1]:  # it went out, some of it: the client reads
                entry[1], entry[2] = size, now
                continue
            entry[1] = size
            if now - entry[2] >= self.stall_s:
                out.append(transport)
            elif entry[0] is not None and now - entry[2] >= self.check_s:
                stalled[entry[0]].append((entry[2], transport))
        for key, items in stalled.items():
            if len(items) > self.per_key:
                items.sort(key=lambda item: item[0])  # stalled the longest first
                out += [transport for _, transport in items[:len(items) - self.per_key]]
                log.warning("%d connections of %s had stopped reading their answers: the %d stalled the "
                            "longest are closed", len(items), key, len(items) - self.per_key)
        for transport in out:
            self._watched.pop(transport, None)
            transport.abort()
        return out


#: the server process's guard (its protocol's connections)
STALLS = StallGuard()
