"""Requests that never arrive: the server closes a connection whose request head or body stops.

uvicorn bounds neither: a connection that sends nothing, or a request head a byte every few
seconds, or a body that stops half way, stays open for as long as its client keeps it (uvicorn's
keep-alive timeout runs only between two requests). Each holds a socket of the server and, for a
body, up to the body limit of its memory; opened by the thousand, before any credential is asked
for, they take every descriptor the server process has and no tenant's request is accepted. The
server's protocol (run_engine/server.py) tells :data:`SLOW` when a request head begins (a
connection's first, from the moment it opens), when the head is complete (its body begins) and
when the body is; a check every ``CHECK_S`` closes a connection whose head took longer than
``HEAD_S``, and one whose body has had no byte for ``BODY_IDLE_S`` or has taken ``BODY_S`` in all
(a body the application is not reading yet, its reading paused, is not idle). A head that timed
out is answered 408 first; a body is cut (its handler reads a disconnect: 400 to no one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from run_engine.api.sweeps import PeriodicSweep

log = logging.getLogger(__name__)

#: the request line and headers must arrive within this (from the first byte, or the connection's start)
HEAD_S = 30.0
#: a request body with no byte for this long is cut
BODY_IDLE_S = 60.0
#: a request body taking longer than this in all is cut (10 MiB at 17 KiB/s)
BODY_S = 600.0
#: how often the requests under way are looked at
CHECK_S = 5.0

_TIMEOUT_408 = (b'{"error":{"code":"request_timeout","message":"the request head did not arrive in time"}}')
ANSWER_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
              b"connection: close\r\n\r\n%s" % (len(_TIMEOUT_408), _TIMEOUT_408))

_HEAD, _BODY = 0, 1


class SlowRequests(PeriodicSweep):
    WHAT = "requests under way"

    def __init__(self, *, head_s: float = HEAD_S, body_idle_s: float = BODY_IDLE_S, body_s: float = BODY_S,
                 check_s: float = CHECK_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.head_s = head_s
        self.body_idle_s = body_idle_s
        self.body_s = body_s
        super().__init__(check_s)
        self.clock = clock
        # protocol -> [phase, since when, last byte seen (a body's)]
        self._open: dict[Any, list[Any]] = {}

    def __len__(self) -> int:
        return len(self._open)

    def head_begins(self, protocol: Any) -> None:
        """A request head begins on ``protocol``'s connection (its first: when it opened)."""
        if protocol not in self._open:
            self._open[protocol] = [_HEAD, self.clock(), 0.0]
            self._arm()

    def body_begins(self, protocol: Any) -> None:
        """``protocol``'s request head is complete: its body (if any) is awaited."""
        now = self.clock()
        self._open[protocol] = [_BODY, now, now]
        self._arm()

    def body_arrives(self, protocol: Any) -> None:
        entry = self._open.get(protocol)
        if entry is not None:
            entry[2] = self.clock()

    def done(self, protocol: Any) -> None:
        """``protocol``'s request arrived whole (or its connection is gone)."""
        self._open.pop(protocol, None)

    def sweep(self) -> list[Any]:
        """Close the connections whose request is late; returns their protocols."""
        now = self.clock()
        heads: list[Any] = []
        bodies: list[Any] = []
        for protocol, entry in list(self._open.items()):
            transport = protocol.transport
            if transport.is_closing():
                del self._open[protocol]
                continue
            if entry[0] == _HEAD:
                if now - entry[1] >= self.head_s:
                    heads.append(protocol)
                continue
            flow, cycle = getattr(protocol, "flow", None), getattr(protocol, "cycle", None)
            if (flow is not None and flow.read_paused) or getattr(cycle, "expect_100_continue", False):
                entry[2] = now  # the application has not read what came yet, or not asked for the body
            elif now - entry[2] >= self.body_idle_s or now - entry[1] >= self.body_s:
                bodies.append(protocol)
        for protocol in heads:
            del self._open[protocol]
            cycle = getattr(protocol, "cycle", None)
            if cycle is None or cycle.response_complete:  # nothing else is writing to it
                protocol.transport.write(ANSWER_408)
            protocol.transport.close()
        for protocol in bodies:
            del self._open[protocol]
            protocol.transport.abort()
        if heads or bodies:
            log.warning("closed %d connections whose request head took over %.0f s and %d whose body stopped "
                        "(%.0f s without a byte, or %.0f s in all)", len(heads), self.head_s, len(bodies),
                        self.body_idle_s, self.body_s)
        return heads + bodies


#: the server process's guard (its protocol's connections)
SLOW = SlowRequests()
