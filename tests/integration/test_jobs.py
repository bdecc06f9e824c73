"""Engine jobs on real Redis, with a fake clock."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import orjson
import pytest

from run_engine.clock import FakeClock
from run_engine.jobs import Job, JobQueue, JobWorker

from .conftest import JOBS_T0

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)

T0 = JOBS_T0


async def test_schedule_replaces_and_claim_waits_until_due(jobs: JobQueue, clock: FakeClock) -> None:
    await jobs.schedule("a", "kind", {"v": 1}, T0 + 10)
    await jobs.schedule("a", "kind", {"v": 2}, T0 + 20)  # same id: replaced
    assert await jobs.size() == 1
    clock.advance(15)
    assert await jobs.claim(10) == []
    clock.advance(5)
    [job] = await jobs.claim(10)
    assert (job.id, job.payload, job.attempt) == ("a", {"v": 2}, 0)


async def test_reschedule_moves_only_existing_jobs_and_ack_cancels(jobs: JobQueue, clock: FakeClock) -> None:
    await jobs.schedule("hb", "kind", {}, T0 + 1)
    assert await jobs.reschedule_many([("hb", T0 + 60), ("gone", T0 + 60)]) == [True, False]
    assert await jobs.get("gone") is None
    got = await jobs.get("hb")
    assert got is not None and got[1] == pytest.approx(T0 + 60)
    await jobs.ack("hb")
    clock.advance(100)
    assert await jobs.claim(10) == []


async def test_claim_is_atomic_between_concurrent_claimers(jobs: JobQueue, clock: FakeClock) -> None:
    await jobs.apply((), [(f"j{i}", "kind", {}, T0, "e1" if i % 3 else "") for i in range(200)])
    batches = await asyncio.gather(*(jobs.claim(7) for _ in range(40)))
    ids = [j.id for batch in batches for j in batch]
    assert len(ids) == len(set(ids)) == 200


async def test_visibility_timeout_redelivers_an_unfinished_job(jobs: JobQueue, clock: FakeClock) -> None:
    await jobs.schedule("v", "kind", {}, T0)
    [first] = await jobs.claim(1, visibility_s=30)
    clock.advance(29)
    assert await jobs.claim(1) == []
    clock.advance(2)
    [again] = await jobs.claim(1)
    assert again.id == first.id


async def test_complete_with_a_stale_token_keeps_the_rescheduled_job(jobs: JobQueue, clock: FakeClock) -> None:
    await jobs.schedule("s", "kind", {"n": 1}, T0)
    [claimed] = await jobs.claim(1)
    await jobs.schedule("s", "kind", {"n": 2}, T0 + 5)  # replaced while its handler ran
    assert await jobs.complete(claimed) is False
    got = await jobs.get("s")
    assert got is not None and got[0].payload == {"n": 2}


async def test_fail_retries_with_growing_delay_then_dead_letters(jobs: JobQueue, clock: FakeClock) -> None:
    await jobs.schedule("f", "kind", {}, T0)
    delays = []
    for _ in range(2):
        [job] = await jobs.claim(1)
        assert await jobs.fail(job, "boom")
        got = await jobs.get("f")
        assert got is not None
        delays.append(got[1] - clock.now())
        clock.set(got[1])
    assert delays == [pytest.approx(1), pytest.approx(2)]
    [job] = await jobs.claim(1)
    assert job.attempt == 2
    await jobs.fail(job, "boom again")
    assert await jobs.get("f") is None
    [(dead, error)] = await jobs.dlq()
    assert dead.id == "f" and error == "boom again"


# --- lanes: one environment's timers must not hold back another's ------------------------------


async def test_a_lanes_flood_due_at_once_does_not_hold_back_another_lanes_later_job(
        jobs: JobQueue, clock: FakeClock) -> None:
    """A million delayed runs of one tenant coming due at the same instant used to be one sorted
    set ahead of every other tenant's timers: another's job due a moment later waited for them all."""
    await jobs.apply((), [(f"a{i}", "kind", {}, T0, "env_a") for i in range(500)])
    await jobs.schedule("b", "kind", {}, T0 + 1, lane="env_b")
    clock.advance(2)
    first = await jobs.claim(10)
    assert "b" in {j.id for j in first}
    assert len(first) == 10  # the rest of the claim is the flood's: no capacity left unused


async def test_the_default_lane_is_claimed_first(jobs: JobQueue, clock: FakeClock) -> None:
    """Heartbeat timeouts and max durations (the default lane) notice dead workers: an
    environment's backlog of timers never delays them."""
    await jobs.apply((), [(f"a{i}", "kind", {}, T0, "env_a") for i in range(50)])
    await jobs.schedule("hb", "kind", {}, T0 + 1)
    clock.advance(2)
    [first, *_] = await jobs.claim(5)
    assert first.id == "hb" and first.lane == ""


async def test_lanes_with_jobs_due_take_turns(jobs: JobQueue, clock: FakeClock) -> None:
    for lane in ("x", "y", "z"):
        await jobs.apply((), [(f"{lane}{i}", "kind", {}, T0 + i / 1000, lane) for i in range(20)])
    clock.advance(1)
    seen: list[str] = []
    for _ in range(10):
        claimed = await jobs.claim(2)
        assert len(claimed) == 2
        seen += [j.lane for j in claimed]
        clock.advance(0.002)  # later claims see the lanes served before as served longest ago
    assert {lane: seen.count(lane) for lane in "xyz"} in ({"x": 7, "y": 7, "z": 6}, {"x": 7, "y": 6, "z": 7},
                                                          {"x": 6, "y": 7, "z": 7})
    # in turn: no lane is served twice before another lane with jobs due is served once
    for i in range(0, len(seen) - 2, 3):
        assert len(set(seen[i:i + 3])) == 3


async def test_a_lanes_jobs_are_found_moved_retried_and_cancelled_in_their_lane(
        jobs: JobQueue, clock: FakeClock) -> None:
    await jobs.schedule("d", "kind", {"n": 1}, T0 + 5, lane="env_a")
    assert await jobs.missing(["d", "nope"]) == ["nope"]
    got = await jobs.get("d")
    assert got is not None and got[0].lane == "env_a" and got[1] == pytest.approx(T0 + 5)
    assert await jobs.reschedule("d", T0 + 1)
    clock.advance(1)
    [job] = await jobs.claim(10)
    assert (job.id, job.lane) == ("d", "env_a")
    assert await jobs.fail(job, "boom")  # retried in its lane, after its back-off
    got = await jobs.get("d")
    assert got is not None and got[0].lane == "env_a" and got[0].attempt == 1
    clock.advance(1)
    [again] = await jobs.claim(10)
    assert again.id == "d"
    assert await jobs.complete(again)
    assert await jobs.missing(["d"]) == ["d"] and await jobs.size() == 0
    assert await jobs.lanes() == []  # a lane left empty is no longer looked at
    await jobs.schedule("c", "kind", {}, T0 + 100, lane="env_a")
    await jobs.ack("c")
    clock.advance(200)
    assert await jobs.claim(10) == []
    assert await jobs.lanes() == []


async def test_a_job_scheduled_again_in_another_lane_is_in_that_lane_alone(jobs: JobQueue, clock: FakeClock) -> None:
    await jobs.schedule("m", "kind", {"n": 1}, T0, lane="env_a")
    await jobs.schedule("m", "kind", {"n": 2}, T0, lane="")
    await jobs.schedule("m", "kind", {"n": 3}, T0, lane="env_b")
    [job] = await jobs.claim(10)
    assert (job.lane, job.payload) == ("env_b", {"n": 3})
    assert await jobs.claim(10) == []


async def test_stats_see_a_backlogged_lane_late(jobs: JobQueue, clock: FakeClock) -> None:
    await jobs.apply((), [(f"a{i}", "kind", {}, T0, "env_a") for i in range(30)])
    clock.advance(10)
    await jobs.claim(5)  # served just now, it is still 10 s behind
    scheduled, lag, dead = await jobs.stats()
    assert (scheduled, dead) == (30, 0) and lag == pytest.approx(10)


async def test_worker_runs_handlers_and_settles_them(jobs: JobQueue, clock: FakeClock) -> None:
    seen: list[str] = []

    async def ok(job: Job) -> None:
        seen.append(job.id)

    async def bad(job: Job) -> None:
        raise RuntimeError("nope")

    worker = JobWorker(jobs, {"ok": ok, "bad": bad})
    await jobs.apply((), [("o1", "ok", {}, T0, ""), ("o2", "ok", {}, T0, "e1"), ("b1", "bad", {}, T0, "e1"),
                          ("u1", "unknown", {}, T0, ""), ("later", "ok", {}, T0 + 100, "e2")])
    assert await worker.run_due_once() == 4
    assert sorted(seen) == ["o1", "o2"]
    assert await jobs.get("o1") is None
    failed = await jobs.get("b1")
    assert failed is not None and failed[0].attempt == 1
    unknown = await jobs.get("u1")  # put back for a process that knows its kind, no attempt counted
    assert unknown is not None and unknown[0].attempt == 0


async def test_worker_loop_picks_up_due_jobs(jobs: JobQueue, clock: FakeClock) -> None:
    done = asyncio.Event()

    async def handler(job: Job) -> None:
        done.set()

    worker = JobWorker(jobs, {"k": handler}, poll_interval_s=0.01)
    await worker.start()
    try:
        await jobs.schedule("x", "k", {}, T0)
        await asyncio.wait_for(done.wait(), 10)
    finally:
        await worker.stop()


async def test_worker_claims_again_as_soon_as_a_slot_frees(jobs: JobQueue, clock: FakeClock) -> None:
    """With every slot busy the worker used to sleep a whole poll interval before its next claim:
    20 slots and a 50 ms poll held a flood of delayed runs to 400 a second. Here the poll is an hour:
    the jobs all run only if a finished job makes room for the next claim at once."""
    done: list[str] = []

    async def handler(job: Job) -> None:
        done.append(job.id)

    await jobs.apply((), [(f"j{i}", "k", {}, T0, "env") for i in range(12)])
    worker = JobWorker(jobs, {"k": handler}, concurrency=2, poll_interval_s=3600)
    await worker.start()
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while len(done) < 12:
            assert asyncio.get_running_loop().time() < deadline, f"only {len(done)} of 12 jobs ran"
            await asyncio.sleep(0.01)
    finally:
        await worker.stop()
    assert sorted(done) == sorted(f"j{i}" for i in range(12))



async def test_one_lanes_slow_jobs_take_neither_the_held_runs_slots_nor_the_next_free_one(
        jobs: JobQueue, clock: FakeClock) -> None:
    """Two tenants' slow jobs (bulk action pages) due first took every slot: the checks of held
    runs, and a third tenant's delay, waited until they all ended. Now a quarter of the slots are
    the default lane's, and a lane past its cap (it took the room nobody else wanted) gives the next
    slot that frees to a lane with jobs due that is under its cap."""
    gates: dict[str, asyncio.Event] = {}
    started: list[str] = []

    async def slow(job: Job) -> None:
        started.append(job.id)
        await gates.setdefault(job.id, asyncio.Event()).wait()

    async def quick(job: Job) -> None:
        started.append(job.id)

    await jobs.apply((), [(f"{lane}{i}", "slow", {}, T0, lane) for lane in ("a", "b") for i in range(10)])
    worker = JobWorker(jobs, {"slow": slow, "quick": quick}, concurrency=8, poll_interval_s=0.01)
    assert (worker.reserved, worker.lane_slots, worker.lane_cap) == (2, 6, 2)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30

    async def until(what: str, condition: Callable[[], bool]) -> None:
        while not condition():
            assert loop.time() < deadline, f"{what}: started {started}"
            await asyncio.sleep(0.01)

    await worker.start()
    try:
        # alone, a and b take every slot but the default lane's: past their caps (3 each)
        await until("the lanes' slots taken", lambda: len(started) == 6)
        assert {j[0] for j in started} == {"a", "b"}
        await jobs.apply((), [("hb", "quick", {}, T0, ""), ("c1", "quick", {}, T0, "c")])
        await until("the held runs' check ran", lambda: "hb" in started)
        assert "c1" not in started  # no lane slot free
        first_a = next(j for j in started if j.startswith("a"))
        gates.setdefault(first_a, asyncio.Event()).set()
        await until("c1 ran in the slot a freed", lambda: "c1" in started)
        assert started.index("c1") == 7  # before any more of a's or b's
    finally:
        for gate in gates.values():
            gate.set()
        for i in range(10):
            for lane in "ab":
                gates.setdefault(f"{lane}{i}", asyncio.Event()).set()
        await worker.stop()


# --- lanes beside a process of the version before them (a rolling upgrade) ---------------------


async def _old_version_writes(jobs: JobQueue, job_id: str, run_at: float, payload: dict[str, object]) -> None:
    """What a process of the version before lanes does to schedule a job: the default lane's sorted
    set and an item without a lane."""
    item = orjson.dumps({"kind": "kind", "payload": payload, "attempt": 0, "token": "old"})
    await jobs.redis.zadd(jobs.due_key, {job_id: int(run_at * 1000)})
    await jobs.redis.hset(jobs.items_key, job_id, item)


async def test_a_lane_job_an_older_process_wrote_again_is_claimed_once_at_its_latest_time(
        jobs: JobQueue, clock: FakeClock) -> None:
    """An older process (a reschedule, a re-arm that saw the job missing from its sorted set) wrote a
    second copy in the default lane: one claim handed the job out twice, and the copy in the lane
    fired at the time the older process had moved away from."""
    await jobs.schedule("d1", "kind", {"n": 1}, T0 + 10, lane="env_a")
    await _old_version_writes(jobs, "d1", T0 + 3600, {"n": 2})
    clock.advance(20)
    assert await jobs.claim(10) == []  # its time is the older process's, the later one
    clock.advance(3600)
    [job] = await jobs.claim(10)
    assert (job.id, job.lane, job.payload) == ("d1", "env_a", {"n": 2})
    await _old_version_writes(jobs, "d2", T0, {})  # and one due now, written the other way round
    await jobs.schedule("d2", "kind", {}, T0, lane="env_a")
    claimed = await jobs.claim(10)
    assert [j.id for j in claimed] == ["d2"]
    assert await jobs.complete(claimed[0]) and await jobs.missing(["d2"]) == ["d2"]
    assert await jobs.redis.zscore(jobs.due_key, "d2") is None


async def test_a_job_an_older_process_put_in_the_default_lane_moves_to_its_lane_when_scheduled_again(
        jobs: JobQueue, clock: FakeClock) -> None:
    """Delays and TTLs armed before the upgrade sat in the default lane until they fired, ahead of
    every lane and of the held runs' checks: the reconciler asks which are misplaced and schedules
    them again, into their environments' lanes."""
    await _old_version_writes(jobs, "delay.r1", T0 + 5, {"run_id": "r1"})
    assert await jobs.missing(["delay.r1"]) == []
    assert await jobs.misplaced([("delay.r1", "env_a"), ("hb.x", "")]) == ["delay.r1", "hb.x"]
    await jobs.schedule("delay.r1", "kind", {"run_id": "r1"}, T0 + 5, lane="env_a")
    assert await jobs.misplaced([("delay.r1", "env_a")]) == []
    assert await jobs.redis.zscore(jobs.due_key, "delay.r1") is None
    clock.advance(10)
    [job] = await jobs.claim(10)
    assert (job.id, job.lane) == ("delay.r1", "env_a")


# --- lanes' places -----------------------------------------------------------------------------


async def test_a_lane_whose_first_job_was_cancelled_takes_no_look_of_a_claim(jobs: JobQueue, clock: FakeClock) -> None:
    """Starting a run cancels its TTL job: its lane stayed placed at that job's time, and once it
    passed, 20 such lanes took every look of a claim of 5, which came back empty while another
    lane's job was due."""
    for i in range(20):
        await jobs.apply((), [(f"ttl.{i}", "kind", {}, T0 + 1, f"env{i:02d}"),
                              (f"later.{i}", "kind", {}, T0 + 1000, f"env{i:02d}")])
    await jobs.schedule("delay.v", "kind", {}, T0 + 5, lane="victim")
    for i in range(20):
        await jobs.ack(f"ttl.{i}")
    clock.advance(10)
    assert [j.id for j in await jobs.claim(5)] == ["delay.v"]


async def test_lanes_take_turns_within_one_millisecond_too(jobs: JobQueue, clock: FakeClock) -> None:
    """A lane served again in the ms it was served took turn 1 again, ahead of lanes served before
    it in that ms: with claims of one job, the lane of the smallest name took every other."""
    for lane in ("env_a", "env_b", "env_c"):
        await jobs.apply((), [(f"{lane}.{i}", "kind", {}, T0, lane) for i in range(40)])
    clock.advance(1)
    seen = [j.lane for _ in range(30) for j in await jobs.claim(1)]  # all within one ms
    assert {lane: seen.count(lane) for lane in ("env_a", "env_b", "env_c")} == {"env_a": 10, "env_b": 10,
                                                                                "env_c": 10}


async def test_a_job_of_a_kind_an_older_process_does_not_know_waits_for_one_that_does(
        jobs: JobQueue, clock: FakeClock) -> None:
    """A rolling upgrade (or a rollback): a process of the version before a kind was added claims
    a job of it. That is no failure of the job: it is put back as it was (no attempt counted), a
    while later, for a process that knows the kind. Before, each such claim counted an attempt
    (and its back-off): an older process claiming it ``max_attempts`` times dead-lettered it, and
    the new process never ran it."""
    ran: list[str] = []

    async def new_kind(job: Job) -> None:
        ran.append(job.id)

    old, new = JobWorker(jobs, {}), JobWorker(jobs, {"new_kind": new_kind})
    await jobs.schedule("n1", "new_kind", {"x": 1}, T0, "e1")
    for _ in range(jobs.max_attempts + 2):  # the old process claims it every time it is due
        assert await old.run_due_once() == 1
        got = await jobs.get("n1")
        assert got is not None, await jobs.dlq()
        job, at = got
        assert (job.attempt, job.payload, job.lane) == (0, {"x": 1}, "e1")
        assert 0 < at - clock.now() <= 60
        clock.set(at)
    assert await new.run_due_once() == 1
    assert ran == ["n1"] and await jobs.get("n1") is None and await jobs.dlq() == []


# --- a job whose stored item cannot be read ----------------------------------------------------


@pytest.mark.parametrize("raw", [b"\xff not json", b"[1, 2]", b'{"kind": "k"}', b'{"kind": "k", "payload": {}, '
                                 b'"attempt": "0", "token": "t"}'])
async def test_an_unreadable_job_goes_to_the_dlq_and_the_jobs_claimed_with_it_run(
        jobs: JobQueue, clock: FakeClock, raw: bytes) -> None:
    """A job item in Redis that is not a job (corrupted, or written by hand) used to make every
    claim that took it raise after leasing its whole batch: the jobs claimed with it ran never
    (their leases ran out together with its, and the next claim took them all again)."""
    seen: list[str] = []

    async def handler(job: Job) -> None:
        seen.append(job.id)

    await jobs.apply((), [("a", "k", {}, T0, ""), ("b", "k", {}, T0, "e1")])
    await jobs.redis.hset(jobs.items_key, "bad", raw)
    await jobs.redis.zadd(jobs.due_key, {"bad": T0 * 1000})
    worker = JobWorker(jobs, {"k": handler}, concurrency=4)
    for _ in range(3):  # as many claims as leases running out
        await worker.run_due_once()
        clock.advance(60)
    assert sorted(seen) == ["a", "b"]
    assert await jobs.get("bad") is None
    [(dead, error)] = await jobs.dlq()
    assert dead.id == "bad" and "cannot be read" in error
    assert (await jobs.stats())[2] == 1


async def test_a_job_item_spoilt_while_its_handler_ran_fails_no_other_jobs_settle(
        jobs: JobQueue, clock: FakeClock) -> None:
    """The settles of jobs ending together go in one script call, which used to raise for all of
    them when one job's item could not be decoded there: none was completed, each ran again."""
    await jobs.apply((), [("x", "k", {}, T0, ""), ("y", "k", {}, T0, "")])
    x, y = sorted(await jobs.claim(10), key=lambda j: j.id)
    await jobs.redis.hset(jobs.items_key, "x", b"\xff spoilt")
    assert await asyncio.gather(jobs.complete(x), jobs.complete(y)) == [False, True]
    assert await jobs.get("y") is None


async def test_a_handler_that_hangs_is_cut_after_ten_leases_and_its_job_tried_again_later(
        jobs: JobQueue, clock: FakeClock) -> None:
    """A handler that never returned (a statement behind a lock that is never released, a Redis
    call that never answers) held its slot for ever: once its lease ran out another process took
    the job and hung on it as well, a slot every lease, until no process had one left. Now a
    handler still running after ten leases is cancelled and its job failed: tried again after its
    back-off, and dead-lettered after its attempts, as any failing job."""
    seen: list[str] = []

    async def hangs(job: Job) -> None:
        await asyncio.Event().wait()

    async def ok(job: Job) -> None:
        seen.append(job.id)

    await jobs.apply((), [("stuck", "hangs", {}, T0 - 1, ""), ("next", "ok", {}, T0, "")])
    worker = JobWorker(jobs, {"hangs": hangs, "ok": ok}, concurrency=1, poll_interval_s=0.01, visibility_s=0.2)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    await worker.start()
    try:
        while "next" not in seen:
            assert loop.time() < deadline, "the job behind the hung one never ran"
            await asyncio.sleep(0.01)
    finally:
        await worker.stop()
    got = await jobs.get("stuck")
    assert got is not None and got[0].attempt == 1
    assert got[1] == pytest.approx(clock.now() + jobs.retry_delay_s(1))
    raw = await jobs.redis.hget(jobs.items_key, "stuck")
    assert "still running after 2.0 s" in orjson.loads(raw)["error"]


async def test_a_dead_job_scheduled_again_leaves_the_job_dlq(jobs: JobQueue, clock: FakeClock) -> None:
    """A job that failed every attempt and is armed again (the reconciler re-arms the job a run
    still needs; the engine schedules the same id anew) is live: its dead copy used to stay in the
    job DLQ for good, listed as dead beside the scheduled job, and counted by
    run_engine_engine_jobs_dead for ever after one outage, with nothing that could clear it."""
    await jobs.apply((), [("d", "k", {"v": 1}, T0, "e1"), ("other", "k", {}, T0, "")])
    for _ in range(jobs.max_attempts):
        for job in await jobs.claim(10):
            await jobs.fail(job, "down")
        clock.advance(jobs.max_retry_s)
    assert sorted(job.id for job, _ in await jobs.dlq()) == ["d", "other"]
    await jobs.schedule("d", "k", {"v": 2}, clock.now(), "e1")  # re-armed
    [(dead, _)] = await jobs.dlq()
    assert dead.id == "other" and (await jobs.stats())[2] == 1
    [job] = await jobs.claim(10)
    assert (job.id, job.payload) == ("d", {"v": 2})


async def test_a_handler_slower_than_its_lease_keeps_it(jobs: JobQueue, clock: FakeClock) -> None:
    """A job merely slow (a bulk action's page on a loaded machine) keeps its lease while its
    handler runs: no other process takes it and runs it beside it, and it is done once."""
    started, release = asyncio.Event(), asyncio.Event()
    ran: list[str] = []

    async def slow(job: Job) -> None:
        ran.append(job.id)
        started.set()
        await release.wait()

    await jobs.apply((), [("slow", "slow", {}, T0 - 1, "")])
    worker = JobWorker(jobs, {"slow": slow}, concurrency=1, poll_interval_s=0.01, visibility_s=0.3)
    loop = asyncio.get_running_loop()
    await worker.start()
    try:
        await asyncio.wait_for(started.wait(), 30)
        first = await jobs.get("slow")
        assert first is not None
        clock.advance(10.0)  # far past the lease it was claimed with
        deadline = loop.time() + 30
        while (got := await jobs.get("slow")) is None or got[1] <= clock.now():
            assert loop.time() < deadline, "the lease was never moved"
            await asyncio.sleep(0.01)
        assert await jobs.claim(10, 0.3) == []  # another process finds nothing to take
        release.set()
        deadline = loop.time() + 30
        while await jobs.get("slow") is not None:
            assert loop.time() < deadline, "the job was never completed"
            await asyncio.sleep(0.01)
    finally:
        release.set()
        await worker.stop()
    assert ran == ["slow"]
