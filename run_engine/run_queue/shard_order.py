"""In which order a dequeue visits the shards of the run queue, per worker group.

Inside a shard the dequeue script is fair between environments; across shards fairness is this
module's: a dequeue visits the shards by **smooth weighted round robin** (as nginx balances its
upstreams), each weighted by the environments with ready runs it had when last visited (the script
returns the count), and stops once it has enough runs. So an environment alone on its shard gets
the same share as each of the environments sharing another one.

* The shard that served a call is charged for it (its credit falls by the total weight), not the
  one visited first: visiting an empty shard first costs a round trip, never another's share.
* A shard that served nothing loses its credit (it must not pile up credit and come first forever).
* A shard seen empty (weight 0) and not visited for ``shards`` calls comes first in the next one: it
  is found again within that many calls once it has runs.
"""

from __future__ import annotations

from collections.abc import Iterator


class ShardOrder:
    def __init__(self, shards: int) -> None:
        self.shards = shards
        self.active = [1] * shards  # environments with ready runs, as last seen (unknown: 1)
        self.credit = [0.0] * shards
        self.last_visit = [0] * shards
        self.calls = 0

    def start(self) -> Visit:
        """A new dequeue (several may be under way at once): the shards in the order to visit."""
        self.calls += 1
        total = sum(self.active)
        for shard, n in enumerate(self.active):
            self.credit[shard] += n
        order = sorted(range(self.shards), key=self.credit.__getitem__, reverse=True)
        empty = [shard for shard in range(self.shards) if self.active[shard] == 0]
        if empty:  # the round robin never brings these first: look at the one unseen longest
            stale = min(empty, key=self.last_visit.__getitem__)
            if self.calls - self.last_visit[stale] > self.shards:
                self.last_visit[stale] = self.calls  # dequeues under way at once probe it once
                order.remove(stale)
                order.insert(0, stale)
        return Visit(self, order, total)


class Visit:
    """One dequeue's walk over the shards."""

    def __init__(self, rotation: ShardOrder, order: list[int], total: int) -> None:
        self.rotation = rotation
        self.order = order
        self.total = total
        self.charged = False

    def __iter__(self) -> Iterator[int]:
        return iter(self.order)

    def visited(self, shard: int, active: int, served: int) -> None:
        """The dequeue of ``shard`` handed out ``served`` runs and left ``active`` environments."""
        r = self.rotation
        r.last_visit[shard] = r.calls
        r.active[shard] = active
        if served == 0:
            r.credit[shard] = 0.0
        elif not self.charged:
            self.charged = True
            r.credit[shard] -= self.total
