"""ShardOrder: the order a dequeue visits the run queue's shards in (pure logic, no Redis)."""

from __future__ import annotations

from run_engine.run_queue.shard_order import ShardOrder


def simulate(envs_per_shard: list[int], calls: int, batch: int = 4) -> list[float]:
    """Runs handed to each environment (per shard, split evenly among its environments) when every
    non-empty shard always has more ready runs than a call takes."""
    order = ShardOrder(len(envs_per_shard))
    served = [0.0] * len(envs_per_shard)
    for _ in range(calls):
        want = batch
        visit = order.start()
        for shard in visit:
            if want == 0:
                break
            n = envs_per_shard[shard]
            got = want if n else 0
            visit.visited(shard, n, got)
            served[shard] += got
            want -= got
    return [served[s] / n for s, n in enumerate(envs_per_shard) for _ in range(n)]


def test_every_environment_gets_the_same_share_whichever_shard_it_is_on() -> None:
    shares = simulate([2, 3, 1, 2, 0, 0, 1, 1], calls=1000)
    assert max(shares) - min(shares) <= 4, shares  # within one batch of each other, after 4,000 runs


def test_a_shard_seen_empty_is_visited_first_again_within_as_many_calls_as_shards() -> None:
    order = ShardOrder(4)
    visit = order.start()
    for shard in visit:  # all look busy at first; shard 3 turns out empty
        visit.visited(shard, 0 if shard == 3 else 5, 0 if shard == 3 else 4)
    firsts = []
    for _ in range(12):
        visit = order.start()
        first = visit.order[0]
        firsts.append(first)
        visit.visited(first, 0 if first == 3 else 5, 0 if first == 3 else 4)
    assert firsts.count(3) >= 2, firsts  # probed every ~5 calls, never left behind
    assert firsts.count(3) <= 3, firsts  # and only that often: an empty shard is a wasted round trip


def test_an_empty_first_visit_charges_the_shard_that_served() -> None:
    order = ShardOrder(2)
    order.active = [0, 2]
    order.last_visit = [-10, 0]
    visit = order.start()
    assert visit.order[0] == 0  # the stale empty shard is looked at first
    visit.visited(0, 0, 0)
    visit.visited(1, 2, 4)
    assert order.credit == [0.0, 0.0]  # shard 1 gained its weight and paid the total


def test_a_shard_that_serves_nothing_does_not_pile_up_credit() -> None:
    order = ShardOrder(2)
    for _ in range(50):  # shard 0 reports environments (rate-limited, say) but hands out nothing
        visit = order.start()
        for shard in visit:
            visit.visited(shard, 1, 0 if shard == 0 else 4)
    assert order.credit[0] <= 1.0


def test_dequeues_under_way_at_once_each_charge_the_shard_that_served_them() -> None:
    order = ShardOrder(2)
    order.active = [1, 3]
    first, second = order.start(), order.start()  # two dequeues before either has an answer
    first.visited(first.order[0], 3 if first.order[0] else 1, 4)
    second.visited(second.order[0], 3 if second.order[0] else 1, 4)
    assert sum(order.credit) == 0.0  # each added the weights once and one shard paid once per call
