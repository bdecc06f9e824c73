"""The worker-group supervisor: connects, long-polls for up to its free capacity, runs each run in
a warm executor, heartbeats, enforces max duration and memory, reports crashes, and on SIGTERM
stops polling, drains in-flight runs and exits 0.

It talks to the engine only over the worker API (HTTP): nothing here imports the engine."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import random
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from run_engine import heap
from run_engine.batching import Batcher
from run_engine.sdk.tasks import MACHINES, deployment
from supervisor.executor import ExecutorFailure, ExecutorPool
from supervisor.metrics import MetricsServer

log = logging.getLogger("run_engine.supervisor")
CANCEL_WATCH_AFTER_S = 1.0  # a run executing longer than this is watched for a cancel (a long-poll)
CANCEL_WATCH_POLL_MS = 25_000
# While runs queue for this supervisor's slots, a freed slot waits up to this long for others to
# free before it dequeues (less once no run holds a slot): one dequeue (a request, a queue call, a
# statement) for several runs rather than one each. Without a backlog a slot dequeues at once
# (trigger-to-start latency).
DEQUEUE_GATHER_S = 0.005
WORKER = "/engine/v1/worker-actions"
CONNECT_TIMEOUT_S = 10.0  # one /connect attempt (60 are made, 0.5 s apart)


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    api_url: str
    token: str
    tasks_module: str
    concurrency: int = 4
    name: str = ""
    heartbeat_interval_s: float = 20.0
    poll_wait_ms: int = 10_000
    environments: tuple[str, ...] = ()
    # a blocked run waits this long in its executor, then is checkpointed (at once while runs queue
    # for the slots: see Supervisor._suspend_at_once)
    suspend_after_s: float = 5.0
    # A finished attempt's result is held and its completion retried (its heartbeats going on) for as
    # long as the engine cannot take it: never given up while the supervisor runs. Once it is told
    # to stop (SIGTERM), a completion is still retried for this long from the stop, or from its
    # first try when that is later; then it is given up (logged) and the supervisor exits.
    completion_retry_s: float = 600.0
    # A completion the engine answers 500 (an error of its own on that result, not unavailability:
    # 503) on every try for this long is sent instead as the attempt's retryable failure
    # COMPLETION_REFUSED; that refused as long too, it is given up and the run's heartbeat timeout
    # retries it. Without a bound a result the engine cannot take kept its run EXECUTING for good
    # and held one of the supervisor's reporting turns (all of them held, no run is dequeued).
    completion_refused_s: float = 300.0
    wait_retry_s: float = 120.0  # how long a wait or trigger-and-wait call is retried likewise
    metrics_port: int | None = None  # serve Prometheus metrics on this port (supervisor/metrics.py)
    metrics_host: str = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    data: Any
    text: str
    retried: bool = False  # an earlier try went unanswered (it may have been done all the same)


class WorkerApi:
    """The worker API over one keep-alive aiohttp session (much less CPU per call than httpx,
    which matters: a supervisor makes two or three calls per run)."""

    def __init__(self, base_url: str, token: str, *, read_timeout_s: float, max_connections: int) -> None:
        self.base_url = base_url.rstrip("/") + WORKER
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self.headers, connector=aiohttp.TCPConnector(limit=self.max_connections),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=self.read_timeout_s))
        return self._session

    async def post(self, path: str, json: Any = None) -> Reply:
        body = b"" if json is None else orjson.dumps(json)
        async with self._client().post(self.base_url + path, data=body) as response:
            raw = await response.read()
        try:
            data = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            data = None
        return Reply(response.status, data, raw[:500].decode(errors="replace"))

    async def get(self, path: str) -> Reply:
        async with self._client().get(self.base_url + path) as response:
            raw = await response.read()
        try:
            data = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            data = None
        return Reply(response.status, data, raw[:500].decode(errors="replace"))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


TransportError = (aiohttp.ClientError, TimeoutError, OSError)


class WaitsRefused(Exception):
    """A ``POST /waits`` of several items refused as a whole (400)."""


class CompletionsTooLarge(Exception):
    """A ``POST /attempts/complete`` of several items refused as a whole (413: over the request
    limit together): the batcher splits it until each run's completion goes alone."""


#: answers after which a request is worth repeating (0: the engine could not be reached)
RETRY_STATUSES = frozenset({0, 429, 500, 502, 503, 504})
#: a heartbeat the engine did not answer (unreachable, 429, 5xx) is tried again this soon rather than
#: a whole interval later: three intervals missed, the run is taken for stalled and run again
HEARTBEAT_RETRY_S = 2.0
#: a completion the engine did not take is tried again after this, the wait doubling up to the cap
COMPLETION_RETRY_FIRST_S = 0.2
COMPLETION_RETRY_MAX_S = 10.0
#: a completion still not taken is logged (at WARNING) at most this often, each try between at DEBUG
COMPLETION_PROGRESS_LOG_S = 60.0


class Supervisor:
    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self.name = config.name or f"{socket.gethostname()}-{os.getpid()}"
        self.pool = ExecutorPool(config.tasks_module)
        self.http = WorkerApi(config.api_url, config.token, read_timeout_s=config.poll_wait_ms / 1000 + 30,
                              max_connections=config.concurrency * 3 + 10)
        # Starts and completions of concurrent runs share one request (the engine batches them too).
        self._starts: Batcher[dict[str, str], dict[str, Any]] = Batcher(self._start_many, max_batch=100)
        self._completions: Batcher[dict[str, Any], dict[str, Any]] = Batcher(self._complete_many, max_batch=100)
        # so do the waits of concurrent runs on tokens and other runs (one request, one statement)
        self._waits: Batcher[dict[str, Any], dict[str, Any]] = Batcher(self._wait_many, max_batch=100)
        self._inflight: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(config.concurrency)
        # A run gives its slot back as soon as its executor is done: its completion is reported
        # while the slot's next run is dequeued (the two requests overlap). At most `concurrency`
        # completions wait for their answer so; past that a finished run keeps its slot until
        # its completion gets through (a server that takes dequeues and refuses completions
        # cannot make this supervisor take run after run).
        self._reporting = asyncio.Semaphore(config.concurrency)
        self._start_failures = 0  # executors that could not be started, in a row
        self._stopping = asyncio.Event()
        self._stopped_at: float | None = None  # when it was told to stop (time.monotonic())
        self._poll: asyncio.Task[Any] | None = None
        self._release: asyncio.Task[None] | None = None
        self.completed = 0
        self.suspended = 0
        self.completions_pending = 0  # finished attempts whose result the engine has not taken yet
        self.completions_lost: list[str] = []  # runs whose completion was given up (as it stopped, or refused)
        self._backlog = False  # the last dequeue left runs of the group ready (more than the free slots)
        self._gathering = False  # a freed slot waits for others before its dequeue (DEQUEUE_GATHER_S)
        self._executing = 0  # runs holding a slot; the gathering ends early once none does
        self._lent = 0  # runs whose wait asks to suspend them, their slot lent to the next dequeue
        self._none_executing = asyncio.Event()
        self.runs_started = 0
        self.metrics = None if config.metrics_port is None else \
            MetricsServer(self, config.metrics_host, config.metrics_port)
        self._environments: list[str] = []
        self._deployments: list[str] = []

    async def _post(self, path: str, json: Any = None) -> Reply:
        return await self.http.post(path, json)

    async def _post_until_answered(self, path: str, json: Any) -> Reply:
        """POST an idempotent call, repeating it with back-off and jitter while the engine cannot
        answer (unreachable, 429, 5xx: a server restart, PostgreSQL or Redis away) for up to
        ``wait_retry_s``; the last answer otherwise."""
        return await self._until_answered(path, lambda: self._post(path, json))

    async def _get_until_answered(self, path: str) -> Reply:
        """GET ``path``, repeated like :meth:`_post_until_answered` while the engine cannot answer."""
        return await self._until_answered(path, lambda: self.http.get(path))

    async def _until_answered(self, path: str, call: Callable[[], Awaitable[Reply]]) -> Reply:
        """``call`` until the engine answers (see :meth:`_post_until_answered`); the answer says
        whether earlier tries went unanswered (``retried``: they may have been done all the same)."""
        deadline = time.monotonic() + self.config.wait_retry_s
        delay = 0.2
        retried = False
        while True:
            try:
                reply = await call()
                if reply.status not in RETRY_STATUSES or time.monotonic() + delay > deadline:
                    return Reply(reply.status, reply.data, reply.text, retried)
                status: int | str = reply.status
            except TransportError as exc:
                if time.monotonic() + delay > deadline:
                    raise
                status = type(exc).__name__
            retried = True
            log.warning("%s not answered (%s); retrying in %.1f s", path, status, delay)
            await asyncio.sleep(delay * (1 + random.random() / 2))
            delay = min(delay * 2, 5.0)

    async def _batch(self, path: str, items: list[Any]) -> list[dict[str, Any]]:
        return (await self._batch_reply(path, items))[0]

    async def _batch_reply(self, path: str, items: list[Any]) -> tuple[list[dict[str, Any]], int]:
        """Per-item results, and the request's own status (not 200: refused or not answered as a
        whole, every item's result then saying so; an item's own status is in its result)."""
        try:
            reply = await self._post(path, {"items": items})
        except TransportError as exc:
            return [{"ok": False, "status": 0, "error": {"code": "transport", "message": str(exc)}}] * len(items), 0
        if reply.status != 200:
            return [{"ok": False, "status": reply.status,
                     **(reply.data or {"error": {"message": reply.text}})}] * len(items), reply.status
        results: list[dict[str, Any]] = reply.data["results"]
        return results, 200

    async def _start_many(self, items: list[dict[str, str]]) -> list[dict[str, Any]]:
        return await self._batch("/attempts/start", items)

    async def _complete_many(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        results, status = await self._batch_reply("/attempts/complete", items)
        if len(items) > 1 and status == 413:  # the request, not one item: the others were not applied
            raise CompletionsTooLarge(results[0])
        return results

    async def _wait_many(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        results, status = await self._batch_reply("/waits", items)
        if len(items) > 1 and status == 400:
            # the request was refused as a whole (one item's waitpoint id or sequence, from task
            # code, is malformed): the batcher splits it, so that only that wait fails. An item
            # refused on its own (400 in its result) is that item's answer: the others were applied
            raise WaitsRefused(results[0])
        return results

    async def _wait_until_answered(self, item: dict[str, Any]) -> Reply:
        """A wait on a waitpoint, sent with the concurrent runs' waits (``POST /waits``) and
        repeated like :meth:`_post_until_answered` while the engine cannot answer; its answer as
        the single call's would be."""
        deadline = time.monotonic() + self.config.wait_retry_s
        delay = 0.2
        retried = False
        while True:
            answer = await self._waits.submit(item)
            status = 200 if answer.get("ok") else int(answer.get("status") or 0)
            if status not in RETRY_STATUSES or time.monotonic() + delay > deadline:
                error = answer.get("error")
                message = str(error.get("message", "")) if isinstance(error, dict) else ""
                return Reply(status, answer, "" if status == 200 else message, retried)
            retried = True
            log.warning("wait of run %s not answered (%s); retrying in %.1f s", item["runId"],
                        status or "unreachable", delay)
            await asyncio.sleep(delay * (1 + random.random() / 2))
            delay = min(delay * 2, 5.0)

    async def connect(self) -> dict[str, Any]:
        importlib.import_module(self.config.tasks_module)
        body: dict[str, Any] = {"workerInstanceName": self.name, "deployment": deployment(),
                                "concurrency": self.config.concurrency}
        if self.config.environments:
            body["environments"] = list(self.config.environments)
        for attempt in range(60):
            try:  # an engine that takes the connection but never answers counts as unreachable
                response = await asyncio.wait_for(self._post("/connect", body), CONNECT_TIMEOUT_S)
            except TransportError as exc:
                if attempt == 59:  # a message and exit 1, not a traceback
                    raise SystemExit(f"error: cannot reach the engine at {self.config.api_url} "
                                     f"after 60 attempts: {exc!r}") from None
                if attempt % 10 == 0:
                    log.warning("the engine at %s cannot be reached (%r); retrying", self.config.api_url, exc)
            else:  # an engine that cannot serve now (429, 5xx: its Redis or PostgreSQL away) is retried too
                if response.status not in RETRY_STATUSES or attempt == 59:
                    break
                log.warning("connect answered %s; retrying", response.status)
            await asyncio.sleep(0.5)
        if response.status != 200:
            raise SystemExit(f"connect failed: {response.status} {response.text}")
        data: dict[str, Any] = response.data
        if self.config.environments:  # --env: only these environments' runs are dequeued
            self._environments = [d["environmentId"] for d in data["deployments"]]
        # only runs of tasks this worker has (a rolling deploy: older or newer workers on the group)
        self._deployments = [d["deploymentId"] for d in data["deployments"]]
        log.info("connected as %s: deployment %s (version %s), %d tasks", self.name, data["deploymentId"],
                 data["version"], len(body["deployment"]["tasks"]))
        return data

    async def _connect_unless_stopped(self) -> bool:
        """Connect, unless told to stop first (SIGTERM while the engine does not answer): False."""
        connecting = asyncio.ensure_future(self.connect())
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not connecting.done():
                connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(connecting, stopping, return_exceptions=True)
        if connecting.cancelled():
            return False
        connecting.result()  # its error, if it failed
        return True

    def stop(self) -> None:
        """Stop polling; in-flight runs finish (SIGTERM). An open long-poll is not cancelled: the
        engine may be handing it runs at this very moment, which would then wait for a heartbeat
        timeout. The engine is told instead, and the poll answers at once (with any runs it got,
        which are drained like the others)."""
        if self._stopping.is_set():
            return
        log.info("stopping: draining %d in-flight runs", len(self._inflight))
        self._stopped_at = time.monotonic()
        self._stopping.set()
        if self._poll is not None:
            self._release = asyncio.get_running_loop().create_task(self._say_stopping())

    async def _say_stopping(self) -> None:
        try:
            await asyncio.wait_for(self._post("/heartbeat", {"workerInstanceName": self.name, "stopping": True}), 5)
        except TransportError:
            log.info("could not tell the engine this worker stops; its poll ends by itself")

    async def run(self) -> None:
        if self.metrics is not None:
            await self.metrics.start()
        try:
            await self._run()
        finally:
            if self.metrics is not None:
                await self.metrics.stop()

    async def _run(self) -> None:
        if not await self._connect_unless_stopped():
            await self.http.close()
            log.info("stopped before it could connect")
            return
        await self.pool.warm(min(self.config.concurrency, 2))
        heap.settle()  # start-up is over: out of the full collections' way (run_engine/heap.py)
        heap.tune()  # and the young collections rarer
        beat = asyncio.create_task(self._worker_heartbeats())
        try:
            while not self._stopping.is_set():
                await self._slots.acquire()
                free = 1
                if self._backlog and self.config.concurrency > 1 and not self._stopping.is_set():
                    self._gathering = True  # the slots freed meanwhile are this dequeue's
                    try:
                        if self._executing:  # no longer than it takes the last of them to free
                            with contextlib.suppress(TimeoutError):
                                async with asyncio.timeout(DEQUEUE_GATHER_S):
                                    await self._none_executing.wait()
                    finally:
                        self._gathering = False
                while free < self.config.concurrency and not self._slots.locked():
                    await self._slots.acquire()
                    free += 1
                if self._stopping.is_set():  # stopped while every slot was busy
                    for _ in range(free):
                        self._slots.release()
                    break
                try:
                    runs = await self._dequeue(free)
                except Exception:  # an answer of an unexpected shape: never out of the loop (runs in flight)
                    log.exception("dequeue failed; retrying")
                    runs = []
                    await asyncio.sleep(0.5)
                for item in runs:
                    self._executing += 1
                    self._none_executing.clear()
                    task = asyncio.create_task(self._handle(item))
                    self._inflight.add(task)
                    task.add_done_callback(self._inflight.discard)
                for _ in range(free - len(runs)):
                    self._slots.release()
            if self._inflight:
                await asyncio.gather(*self._inflight, return_exceptions=True)
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
            if self._release is not None:
                await self._release
            self.pool.close()
            await self.http.close()
        if self.completions_lost:
            log.error("stopped with %d completions the engine did not take, lost: their runs are retried at "
                      "their heartbeat timeout (the task runs again): %s", len(self.completions_lost),
                      ", ".join(self.completions_lost))
        log.info("stopped after %d runs", self.completed)

    async def _dequeue(self, max_runs: int) -> list[dict[str, Any]]:
        # startAttempts: the server starts the attempts in the same request (one round trip less
        # per run); each run comes back with its `attempt`.
        self._poll = asyncio.create_task(self._post("/dequeue", {
            "maxRuns": max_runs, "waitMs": self.config.poll_wait_ms, "workerInstanceName": self.name,
            "startAttempts": True, "deployments": self._deployments,
            **({"environments": self._environments} if self._environments else {})}))
        try:
            response = await self._poll
        except asyncio.CancelledError:
            if self._stopping.is_set():
                return []
            raise
        except TransportError as exc:
            log.warning("dequeue failed (%s); retrying", exc)
            await asyncio.sleep(0.5)
            return []
        finally:
            self._poll = None
        if response.status != 200:
            log.warning("dequeue answered %s: %s", response.status, response.text[:200])
            await asyncio.sleep(0.5)
            return []
        runs: list[dict[str, Any]] = response.data["runs"]
        self._backlog = bool(response.data.get("backlog"))
        return runs

    async def _worker_heartbeats(self) -> None:
        while True:
            await asyncio.sleep(30)
            with contextlib.suppress(*TransportError):
                await self._post("/heartbeat", {"workerInstanceName": self.name})

    async def _handle(self, item: dict[str, Any]) -> None:
        slot = _Slot(self._slot_freed, self._slot_taken)
        try:
            await self._execute(item, slot)
        except Exception:
            log.exception("run %s: supervisor error", item["run"]["id"])
        finally:
            slot.release()

    def _slot_freed(self) -> None:
        self._slots.release()
        self._executing -= 1
        if not self._executing:
            self._none_executing.set()

    async def _slot_taken(self) -> None:
        await self._slots.acquire()
        self._executing += 1
        self._none_executing.clear()

    async def _execute(self, item: dict[str, Any], slot: _Slot) -> None:
        run_id = item["run"]["id"]
        started = item.get("attempt") or await self._starts.submit(
            {"runId": run_id, "snapshotId": item["snapshot"]["id"]})
        if not started["ok"]:
            log.info("run %s: not started (%s %s)", run_id, started.get("status"), started.get("error"))
            return
        state = RunState(run_id, started["snapshot"]["id"], slot=slot, attempt=started.get("attemptNumber"))
        self.runs_started += 1
        # built before an executor is taken: an answer missing a field fails here, holding nothing
        msg = {"type": "run", "runId": run_id, "task": started["run"]["taskIdentifier"],
               "payload": started["payload"], "attempt": started["attemptNumber"], "tags": started["run"]["tags"],
               "queue": started["run"]["queue"], "runToken": started["runToken"], "apiUrl": self.config.api_url,
               "journal": started.get("journal") or [], "journalNext": started.get("journalNext"),
               "metadata": started["run"].get("metadata")}
        try:
            executor = await self.pool.acquire(memory_mb=MACHINES.get(started.get("machine") or "small-1x"))
        except Exception as exc:
            # reported, retryable: the run is not left EXECUTING without heartbeats until the
            # engine takes it for stalled. The slot is kept for a back-off that doubles with each
            # failure in a row (up to 30 s, under the EXECUTING timeout), so that a supervisor that
            # cannot fork does not dequeue and fail runs as fast as it can.
            self._start_failures += 1
            log.error("run %s: no executor could be started (%d in a row): %r", run_id, self._start_failures, exc)
            beat = _Later(self.config.heartbeat_interval_s, lambda: self._run_heartbeats(state, None), run_id,
                          "heartbeats while its failure is reported")
            try:
                await asyncio.sleep(min(30.0, 0.5 * 2 ** (self._start_failures - 1)))
                async with self._reporting_turn():
                    slot.release()
                    await self._complete(run_id, {
                        "runId": run_id, "snapshotId": state.snapshot_id, "ok": False, "retryable": True,
                        "error": {"type": "TASK_PROCESS_START_FAILED",
                                  "message": f"no executor process could be started: {exc!r}"}})
            finally:
                await beat.stop()
            return
        self._start_failures = 0
        beat = _Later(self.config.heartbeat_interval_s, lambda: self._run_heartbeats(state, executor), run_id,
                      "heartbeats")
        watch = _Later(CANCEL_WATCH_AFTER_S, lambda: self._watch_cancel(state, executor), run_id, "cancel watch")
        calls: set[asyncio.Task[None]] = set()

        def on_call(msg: dict[str, Any]) -> None:
            task = asyncio.create_task(self._on_call(state, executor, msg))
            calls.add(task)
            task.add_done_callback(calls.discard)

        try:
            result = await executor.run(msg, max_duration_s=started.get("maxDuration"),
                                        memory_mb=MACHINES.get(started.get("machine") or "small-1x"), on_call=on_call)
        except ExecutorFailure as exc:
            error, retryable = exc.error, exc.retryable
            if state.cancelled:
                error, retryable = {"type": "CANCELED", "message": "Run was cancelled"}, False
            log.info("run %s: %s", run_id, error["message"])
            result = {"ok": False, "error": error, "retryable": retryable}
        finally:
            for task in list(calls):
                task.cancel()
            beat.cancel()
            watch.cancel()
            try:
                await beat.stop()
                await watch.stop()
            finally:
                self.pool.release(executor)
        if result.get("type") == "suspended":
            self.suspended += 1
            return  # checkpointed: restored by replay when its waitpoints complete
        if result.get("type") == "abandoned":
            # a duplicate execution (or the run moved on): only a cancel is worth reporting
            log.info("run %s: execution abandoned (%s)", run_id, result.get("reason", "the run moved on"))
            result = {"ok": False, "error": {"type": "CANCELED", "message": "Run was cancelled"}, "retryable": False}
            latest = await self._latest(run_id)
            if latest is None or latest.get("executionStatus") != "PENDING_CANCEL":
                return
        # Heartbeats go on while the completion is retried, however long: the attempt finished and
        # its result is held here; taken for stalled, the run would be retried and its task run again
        beat = _Later(self.config.heartbeat_interval_s, lambda: self._run_heartbeats(state, None), run_id,
                      "heartbeats while its completion is reported")
        try:
            async with self._reporting_turn():
                slot.release()  # the next run may start while this one's completion is on its way
                complete = await self._complete(run_id, {"runId": run_id, "snapshotId": state.snapshot_id, **result})
        finally:
            await beat.stop()
        if not complete["ok"]:
            log.info("run %s: completion refused (%s %s)", run_id, complete.get("status"), complete.get("error"))
        self.completed += 1

    @contextlib.asynccontextmanager
    async def _reporting_turn(self) -> AsyncIterator[None]:
        """One of the ``concurrency`` completions that may wait for their answer with their slot
        given back (see ``_reporting``); waited for while all are taken, but not once the
        supervisor stops: no dequeue is left for the slots, and every held completion must be tried
        before it exits."""
        held = await self._take_reporting()
        try:
            yield
        finally:
            if held:
                self._reporting.release()

    async def _take_reporting(self) -> bool:
        """Take a reporting turn (True), or none when the supervisor stops first (False)."""
        if not self._reporting.locked():
            await self._reporting.acquire()  # free: taken without yielding
            return True
        if self._stopping.is_set():
            return False
        taking = asyncio.ensure_future(self._reporting.acquire())
        stopping = asyncio.ensure_future(self._stopping.wait())

        def unwanted(task: asyncio.Future[Any]) -> None:  # taken after all as it was given up: back
            if not task.cancelled() and task.exception() is None:
                self._reporting.release()

        try:
            await asyncio.wait((taking, stopping), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            taking.cancel()
            taking.add_done_callback(unwanted)
            raise
        finally:
            stopping.cancel()
        if taking.done():
            return True
        taking.cancel()
        taking.add_done_callback(unwanted)
        return False

    async def _complete(self, run_id: str, item: dict[str, Any]) -> dict[str, Any]:
        """Report an attempt's result until the engine answers it: taken, or refused (a 409 when
        an earlier try got through and its answer was lost, or the run moved on; another 4xx).
        Repeating is safe: a completion that got through is refused as stale, and nothing runs
        twice. While the engine cannot take it (unreachable, 429, 5xx: a restart, PostgreSQL or
        Redis away) the result is held and tried again with capped exponential back-off for as
        long as that lasts, the run's heartbeats going on: given up, the run would be retried at
        its heartbeat timeout and its finished task run again. Only a supervisor told to stop
        gives it up, ``completion_retry_s`` after the stop (or after its first try, when later):
        logged, and listed as lost when it exits."""
        first = time.monotonic()
        delay = COMPLETION_RETRY_FIRST_S
        shrunk = refused = False
        refused_since: float | None = None  # the first of the 500s answered in a row
        tries = 0
        logged_at: float | None = None
        self.completions_pending += 1
        try:
            while True:
                answer = await self._completions.submit(item)
                tries += 1
                status = 200 if answer["ok"] else answer.get("status", 0)
                if status == 413 and not shrunk:
                    # an output over the engine's limit would be the same on every attempt: the run
                    # fails now; an error too large is cut down. Either way the run does not stay
                    # EXECUTING until its heartbeat timeout
                    item, shrunk = too_large(item, answer), True
                    continue
                if status not in RETRY_STATUSES:
                    if logged_at is not None:
                        log.info("run %s: completion answered (%s) after %.0f s and %d tries", run_id, status,
                                 time.monotonic() - first, tries)
                    if status == 409:
                        log.info("run %s: the completion was already taken (or the run moved on)", run_id)
                    return answer
                now = time.monotonic()
                if status != 500:
                    refused_since = None
                elif refused_since is None:
                    refused_since = now
                elif now - refused_since >= self.config.completion_refused_s:
                    if not refused:
                        log.error("run %s: the engine answered its completion 500 on every try for %.0f s (%s); "
                                  "reporting the attempt as failed (COMPLETION_REFUSED, retryable) instead",
                                  run_id, now - refused_since, _error_text(answer))
                        item, refused, refused_since = refused_result(item, answer), True, None
                        delay = COMPLETION_RETRY_FIRST_S
                        continue
                    log.error("run %s: the engine refused its result and its failure with 500 for %.0f s each; "
                              "giving it up (the run's heartbeat timeout retries it, and its task runs again)",
                              run_id, self.config.completion_refused_s)
                    self.completions_lost.append(run_id)
                    return answer
                if self._stopped_at is not None and \
                        now + delay > max(self._stopped_at, first) + self.config.completion_retry_s:
                    log.error("run %s: the supervisor stops and the engine has not taken its completion (%s) "
                              "in %.0f s and %d tries; giving it up (the run's heartbeat timeout retries it, "
                              "and its task runs again)", run_id, status or "unreachable", now - first, tries)
                    self.completions_lost.append(run_id)
                    return answer
                if logged_at is None:
                    log.warning("run %s: completion not taken (%s); held and retried until the engine takes or "
                                "refuses it", run_id, status or "unreachable")
                    logged_at = now
                elif now - logged_at >= COMPLETION_PROGRESS_LOG_S:
                    log.warning("run %s: completion still not taken after %.0f s and %d tries (last: %s); "
                                "retrying every %.0f s at most", run_id, now - first, tries,
                                status or "unreachable", COMPLETION_RETRY_MAX_S)
                    logged_at = now
                else:
                    log.debug("run %s: completion not taken (%s); retrying in %.1f s", run_id,
                              status or "unreachable", delay)
                stopping = self._stopping.is_set()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay * (1 + random.random() / 2)):
                        if stopping:
                            await asyncio.Future()  # the whole back-off
                        else:
                            await self._stopping.wait()  # told to stop: tried once more at once
                delay = min(delay * 2, COMPLETION_RETRY_MAX_S)
        finally:
            self.completions_pending -= 1

    async def _latest(self, run_id: str, after: str | None = None, wait_ms: int = 0) -> dict[str, Any] | None:
        query = f"?after={after}&waitMs={wait_ms}" if after else ""
        try:
            reply = await self.http.get(f"/runs/{run_id}/snapshots/latest{query}")
        except TransportError:
            return None
        return reply.data["snapshot"] if reply.status == 200 else None

    async def _latest_since(self, state: RunState, held: str) -> tuple[dict[str, Any] | None, bool | None]:
        """The run's latest snapshot, and whether it continues the execution that held ``held``
        (this supervisor's waits, their continuations in place, their suspension): False when it
        is another execution's (restored elsewhere after a suspension this supervisor never saw,
        another attempt), None when the engine cannot say. The attempt number cannot tell: a
        restore keeps it."""
        try:
            reply = await self.http.get(f"/runs/{state.run_id}/snapshots/latest?since={held}")
        except TransportError:
            return None, None
        if reply.status != 200 or not reply.data or "sameExecution" not in reply.data:
            return None, None
        return reply.data["snapshot"], reply.data["sameExecution"] is True

    async def _on_call(self, state: RunState, executor: Any, msg: dict[str, Any]) -> None:
        """A journaled call of the running task: journal a step, or wait (maybe suspending)."""
        try:
            if msg["op"] == "journal":
                executor.reply(msg["id"], await self._journal(state, msg))
            elif msg["op"] == "journal_page":  # the replay got past the journal's first page
                page = await self._get_until_answered(f"/runs/{state.run_id}/journal?from={int(msg['sequence'])}")
                executor.reply(msg["id"], self._answer(page, {"journal": page.data.get("journal", []),
                                                              "next": page.data.get("next")}
                                                       if page.status == 200 else {}))
            elif msg["op"] == "wait":
                answer = await self._wait(state, executor, msg)
                if answer is not None:
                    executor.reply(msg["id"], answer)
            else:
                executor.reply(msg["id"], {"error": f"unknown call {msg['op']!r}"})
        except TransportError as exc:
            executor.reply(msg["id"], {"error": f"the engine could not be reached: {exc}"})
        except Exception as exc:  # never leave the task's call unanswered: it would wait until max duration
            log.exception("run %s: a %s call of its task failed", state.run_id, msg.get("op"))
            executor.reply(msg["id"], {"error": f"the supervisor could not handle the call: {exc!r}"})

    @staticmethod
    def _answer(reply: Reply, ok: dict[str, Any]) -> dict[str, Any]:
        if reply.status == 200:
            return ok
        error = (reply.data or {}).get("error", {}) if isinstance(reply.data, dict) else {}
        if reply.status == 409:
            return {"duplicate": True, "message": error.get("message", reply.text)}
        return {"error": f"{reply.status} {error.get('message', reply.text)}"}

    async def _journal(self, state: RunState, msg: dict[str, Any]) -> dict[str, Any]:
        """Journal a step's result. Repeated while the engine cannot answer; a repeat refused as a
        duplicate (409) is our own first call having got through: accepted when the journal holds
        exactly what we sent."""
        path = f"/runs/{state.run_id}/journal"
        sent = {"snapshotId": state.snapshot_id, "sequence": msg["sequence"], "kind": "step", "key": msg["key"],
                "result": msg["result"]}
        try:
            reply: Reply | None = await self._post(path, sent)
        except TransportError:
            reply = None
        if reply is None or reply.status in RETRY_STATUSES:
            reply = await self._post_until_answered(path, sent)
            if reply.status == 409:
                journal = await self.http.get(f"{path}?from={msg['sequence']}")
                entries = journal.data.get("journal", []) if journal.status == 200 else []
                if (entries and entries[0]["sequence"] == msg["sequence"] and entries[0]["key"] == msg["key"]
                        and entries[0].get("result") == msg["result"]):
                    return {}
        return self._answer(reply, {})

    async def _wait(self, state: RunState, executor: Any, msg: dict[str, Any]) -> dict[str, Any] | None:
        """Block the run; answer when the wait is over, or suspend the run after the grace period
        (``None``: the executor is told to stop instead)."""
        seq = msg["sequence"]
        suspend = self._suspend_at_once()
        if suspend:
            # Asked to suspend, a run nearly always is: its slot goes to the next dequeue while
            # the wait is asked rather than once it is answered, and its executor counts as on
            # its way back. A run that goes on after all (its wait was over, or refused) takes a
            # slot again before its task goes on.
            self._lend(state, executor)
        try:
            reply = await self._ask_wait(state, msg, suspend)
        except asyncio.CancelledError:  # the run is over: its slot stays free
            self._lent -= suspend
            raise
        except Exception:  # the task is told of the error and goes on
            self._lent -= suspend
            if suspend:
                await self._lent_back(state, executor)
            raise
        self._lent -= suspend
        if reply.status == 200 and isinstance(reply.data, dict) and isinstance(reply.data.get("snapshot"), dict):
            state.snapshot_id = reply.data["snapshot"]["id"]  # before waiting for a slot: heartbeats name it
        if suspend and not (reply.status == 200 and isinstance(reply.data, dict) and reply.data.get("blocked")
                            and reply.data.get("suspended")):
            await self._lent_back(state, executor)
        if reply.status != 200:
            return self._answer(reply, {})
        data = reply.data
        state.snapshot_id = data["snapshot"]["id"]
        if not data["blocked"]:
            return {"result": data["entry"]["result"]}
        if data.get("suspended"):  # checkpointed with the wait: the executor stops, the slot frees
            self._suspend(state, executor)
            return None
        deadline = time.monotonic() + self.config.suspend_after_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                try:
                    suspended: Reply | None = await self._post(
                        f"/runs/{state.run_id}/snapshots/{state.snapshot_id}/suspend")
                except TransportError:  # the engine away (a restart): look at the run below, ask again later
                    suspended = None
                if suspended is not None and suspended.status == 200:
                    self._suspend(state, executor)
                    return None
                deadline = time.monotonic() + self.config.suspend_after_s  # moved on: look at it below
                remaining = 0
            latest = await self._latest(state.run_id, state.snapshot_id, int(min(max(remaining, 0), 10) * 1000))
            if latest is None or latest["id"] == state.snapshot_id:
                if latest is None:
                    await asyncio.sleep(0.2)
                continue
            if latest["executionStatus"] == "SUSPENDED":  # a suspend that got through, its answer lost
                state.snapshot_id = latest["id"]
                self._suspend(state, executor)
                return None
            if latest["executionStatus"] != "EXECUTING":  # cancelled, or finished meanwhile
                state.cancelled = latest["executionStatus"] == "PENDING_CANCEL"
                executor.kill()
                return None
            if latest.get("previousSnapshotId") not in (None, state.snapshot_id):
                # EXECUTING, but not continued from our wait: the engine suspended the run itself
                # (its waiting timeout) and it was restored elsewhere. That execution is the run's
                log.info("run %s executes elsewhere (restored): stopping this execution", state.run_id)
                executor.kill()
                return None
            state.snapshot_id = latest["id"]
            journal = await self._get_until_answered(f"/runs/{state.run_id}/journal?from={seq}")
            entries = journal.data["journal"] if journal.status == 200 else []
            if entries and entries[0]["sequence"] == seq and entries[0]["resolved"]:
                return {"result": entries[0]["result"]}
            return {"error": f"the wait at journal position {seq} continued without a result"}

    async def _ask_wait(self, state: RunState, msg: dict[str, Any], suspend: bool) -> Reply:
        seq, kind = msg["sequence"], msg["kind"]
        base = f"/runs/{state.run_id}/snapshots/{state.snapshot_id}"
        # journaled at ``seq``, so repeating the call is safe: a repeat finds the wait (and the
        # children it created) instead of making another
        head = {"sequence": seq, **({"suspend": True} if suspend else {})}
        if msg.get("waitpointId"):
            reply = await self._wait_until_answered({"runId": state.run_id, "snapshotId": state.snapshot_id,
                                                     "waitpointId": msg["waitpointId"], **head, "kind": kind})
            if reply.status == 409 and reply.retried:
                reply = await self._written_by_an_earlier_try(state, msg) or reply
            return reply
        if kind == "wait":
            when = {"date": msg["date"]} if msg.get("date") else {"seconds": msg.get("seconds", 0)}
            reply = await self._post_until_answered(f"{base}/wait/duration", {**head, **when})
        else:
            reply = await self._post_until_answered(f"{base}/trigger", {**head, "batch": msg["batch"],
                                                                        "items": msg["items"]})
        if reply.status == 409 and reply.retried:  # stale: maybe our own try, whose answer was lost
            reply = await self._written_by_an_earlier_try(state, msg) or reply
        return reply

    def _lend(self, state: RunState, executor: Any) -> None:
        """The run's slot is free for the next dequeue and its executor counts as coming back,
        before the engine has said the run is suspended (see :meth:`_wait`)."""
        self._lent += 1
        self.pool.returning(executor)
        if state.slot is not None:
            state.slot.release()

    async def _lent_back(self, state: RunState, executor: Any) -> None:
        """The run was not suspended after all: its executor stays, and it waits for a free slot
        before its task goes on (at most ``concurrency`` runs execute, as ever)."""
        self.pool.not_returning(executor)
        if state.slot is not None:
            await state.slot.take_back()

    async def _written_by_an_earlier_try(self, state: RunState, msg: dict[str, Any]) -> Reply | None:
        """A wait refused as stale (409) after a try that went unanswered: if that try got through
        (the journal holds this very wait at its sequence and the run moved on from it), its
        outcome as the engine would have answered it; else None (another execution's wait)."""
        seq, wp_id = msg["sequence"], msg.get("waitpointId")  # none for a duration or a trigger
        journal = await self.http.get(f"/runs/{state.run_id}/journal?from={seq}")
        entries = journal.data.get("journal", []) if journal.status == 200 and journal.data else []
        if not (entries and entries[0]["sequence"] == seq and entries[0]["kind"] == msg["kind"]
                and (wp_id is None or wp_id in (entries[0]["key"], entries[0].get("waitpointId")))):
            return None
        latest, ours = await self._latest_since(state, state.snapshot_id)
        if ours is None:  # an engine that cannot say (older than sameExecution): as it was told then
            latest = await self._latest(state.run_id)
            ours = latest is not None and (state.attempt is None
                                           or latest.get("attemptNumber") in (None, state.attempt))
        if latest is None or not ours:
            return None  # unknown, or another execution's (a restore elsewhere, another attempt)
        status = latest["executionStatus"]
        if status == "SUSPENDED":
            return Reply(200, {"blocked": True, "suspended": True, "snapshot": latest}, "")
        if status == "EXECUTING_WITH_WAITPOINTS":
            return Reply(200, {"blocked": True, "snapshot": latest}, "")
        if status == "EXECUTING" and entries[0]["resolved"] and latest.get("checkpointId") is None:
            return Reply(200, {"blocked": False, "snapshot": latest, "entry": entries[0]}, "")  # continued in place
        return None

    def _suspend(self, state: RunState, executor: Any) -> None:
        """The run is checkpointed: tell its executor to stop, and give its slot back at once (the
        next dequeue need not wait for the executor's answer; the pool hands that executor to the
        next run when it is back)."""
        executor.suspend()
        self.pool.returning(executor)
        if state.slot is not None:
            state.slot.release()

    def _suspend_at_once(self) -> bool:
        """Suspend a run that blocks without the grace period: when there is none, or when runs
        queue for this supervisor's slots (none is free, or the free ones are being gathered for
        the next dequeue or were lent by runs being suspended, and its last dequeue said runs
        of the group were still ready). A waiting run then holds no slot another run could use;
        at worst (another worker took those runs) it pays a restore it could have saved."""
        return self.config.suspend_after_s <= 0 or (
            self._backlog and (self._slots.locked() or self._gathering or self._lent > 0))

    async def _watch_cancel(self, state: RunState, executor: Any) -> None:
        """Stop the executor within a moment of a cancel instead of at the next heartbeat: a run
        still executing after CANCEL_WATCH_AFTER_S holds a long-poll on its snapshot, which a cancel
        wakes (short runs never open one, so the hot path pays nothing: it is started by a timer,
        see :class:`_Later`)."""
        after = state.snapshot_id
        while True:
            latest = await self._latest(state.run_id, after, CANCEL_WATCH_POLL_MS)
            if latest is None:  # the engine is unreachable or busy: the heartbeat still catches a cancel
                await asyncio.sleep(1.0)
                continue
            if latest["id"] == after:
                continue
            after = latest["id"]  # a wait moved the run on: the waiter handles that; watch from there
            if latest["executionStatus"] == "PENDING_CANCEL":
                log.info("run %s was cancelled: stopping its executor", state.run_id)
                state.cancelled = True
                executor.kill()
                return

    async def _run_heartbeats(self, state: RunState, executor: Any | None) -> None:
        """Heartbeat the run every interval, the first once one has passed (started by a timer, see
        :class:`_Later`); when it moved on (cancelled), kill its executor (None: nothing runs).
        A heartbeat that fails otherwise than by transport (an answer of an unexpected shape) is
        logged and the next one goes out: a run whose heartbeats stopped would be taken for stalled
        and run again while it still runs."""
        while True:
            try:
                if await self._heartbeat(state, executor):
                    return
                wait_s = self.config.heartbeat_interval_s if state.beat_answered else HEARTBEAT_RETRY_S
            except Exception:
                log.warning("run %s: a heartbeat failed; the next one is due in %ss", state.run_id,
                            self.config.heartbeat_interval_s, exc_info=True)
                wait_s = self.config.heartbeat_interval_s
            await asyncio.sleep(min(wait_s, self.config.heartbeat_interval_s))

    async def _heartbeat(self, state: RunState, executor: Any | None) -> bool:
        """One heartbeat; True when the run moved on and the heartbeats stop."""
        snapshot_id = state.snapshot_id
        state.beat_answered = False  # until the engine answers it: the next try comes sooner
        try:
            response = await self._post(f"/runs/{state.run_id}/snapshots/{snapshot_id}/heartbeat")
        except TransportError:
            return False
        state.beat_answered = response.status not in RETRY_STATUSES
        if response.status != 409:
            return False
        latest = (response.data or {}).get("error", {}).get("latestSnapshot", {})
        if snapshot_id != state.snapshot_id:
            return False  # a wait moved the snapshot on meanwhile; the next heartbeat names the new one
        if latest.get("executionStatus") in ("EXECUTING", "EXECUTING_WITH_WAITPOINTS"):
            # a wait moving the snapshot on (the waiter picks the new one up), or another execution
            # running (another attempt, or this one restored elsewhere after a suspension for a
            # wait that took too long): this one was taken for stalled while this supervisor could
            # not reach the engine, and must stop
            full, ours = await self._latest_since(state, snapshot_id)
            if ours is None:  # an engine that cannot say (older than sameExecution): the attempt number
                full = await self._latest(state.run_id)
                if (full is not None and state.attempt is not None
                        and full.get("attemptNumber") not in (None, state.attempt)):
                    ours = False
            if full is None or ours is not False or snapshot_id != state.snapshot_id:
                return False  # ours (a wait moving it on), or unknown: the next heartbeat asks again
            latest = full
        # cancelled, finished, or another attempt's: this execution stops
        if executor is None:
            return True
        log.info("run %s moved on to %s: stopping its executor", state.run_id, latest.get("executionStatus"))
        state.cancelled = True
        executor.kill()
        return True


class _Later:
    """A coroutine started after ``delay_s`` unless stopped first: until then a timer, not a task.
    Most runs end before their first heartbeat or cancel watch is due, and a task that is made,
    sleeps and is cancelled costs ten times a timer (~10 against ~1 us, three per run).

    The coroutine is a run's helper (heartbeats, cancel watch): an error it ends with is logged by
    :meth:`stop`, never raised into the run, whose completion must still be reported and whose
    executor must still go back to the pool."""

    __slots__ = ("_factory", "_handle", "_run_id", "_task", "_what")

    def __init__(self, delay_s: float, factory: Callable[[], Coroutine[Any, Any, Any]], run_id: str,
                 what: str) -> None:
        self._factory = factory
        self._run_id = run_id
        self._what = what
        self._task: asyncio.Task[Any] | None = None
        self._handle = asyncio.get_running_loop().call_later(delay_s, self._start)

    def _start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._factory())

    def cancel(self) -> None:
        """Cancel the timer, or the coroutine once started (without waiting for it)."""
        self._handle.cancel()
        if self._task is not None:
            self._task.cancel()

    async def stop(self) -> None:
        """Cancel, and wait for the coroutine to end if it started; its error, if it ended with
        one, is logged. Raises only if the caller itself is cancelled meanwhile."""
        self.cancel()
        task = self._task
        if task is None:
            return
        await asyncio.wait((task,))
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("run %s: its %s failed", self._run_id, self._what, exc_info=exc)


class _Slot:
    """One of the supervisor's slots held by a run; released once, whichever comes first: its
    executor done (the completion then goes on without it) or the run's end."""

    __slots__ = ("_free", "_held", "_take")

    def __init__(self, free: Callable[[], None], take: Callable[[], Awaitable[None]] | None = None) -> None:
        self._free = free
        self._take = take
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._free()

    async def take_back(self) -> None:
        """Hold the slot again (a run lent it while its wait was asked and goes on after all):
        waits for a free one, as a dequeue does."""
        if not self._held and self._take is not None:
            await self._take()
            self._held = True


#: what is kept of an attempt's error message and stack trace refused as too large
ERROR_KEPT_CHARS = 64 * 1024


def too_large(item: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """A completion refused for its size (413), as it is sent again (once): a successful attempt's
    as a non-retryable OUTPUT_TOO_LARGE failure, a failed attempt's with its error's message and
    stack trace cut down."""
    error = answer.get("error")
    why = error.get("message") if isinstance(error, dict) else None
    base = {"runId": item["runId"], "snapshotId": item["snapshotId"], "ok": False}
    if item.get("ok"):
        return {**base, "retryable": False, "error": {
            "type": "OUTPUT_TOO_LARGE", "name": "OutputTooLarge",
            "message": f"the task's output is larger than the engine accepts ({why or 'HTTP 413'})"}}
    cut: dict[str, Any] = {}
    for key, value in (item.get("error") or {}).items():
        if key in ("message", "stackTrace") and isinstance(value, str) and len(value) > ERROR_KEPT_CHARS:
            value = value[:ERROR_KEPT_CHARS] + f"… [cut: {len(value)} characters in all]"
        if key in ("type", "name", "message", "stackTrace", "code"):
            cut[key] = value if not isinstance(value, str) else value[:ERROR_KEPT_CHARS * 2]
    cut.setdefault("message", "the attempt's error was too large to store")
    return {**base, "retryable": item.get("retryable", True), "error": cut}


def _error_text(answer: dict[str, Any]) -> str:
    error = answer.get("error")
    if not isinstance(error, dict):
        return "no error given"
    return f"{error.get('code', 'error')}: {str(error.get('message', ''))[:200]}"


def refused_result(item: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """A completion the engine kept answering 500, as it is sent instead (once): the attempt's
    retryable failure, without the output or error the engine could not take (the retry policy
    decides whether the task runs again)."""
    what = "output" if item.get("ok") else "error"
    return {"runId": item["runId"], "snapshotId": item["snapshotId"], "ok": False, "retryable": True,
            "error": {"type": "COMPLETION_REFUSED", "name": "CompletionRefused",
                      "message": f"the engine could not take the attempt's {what} ({_error_text(answer)})"}}


@dataclass(eq=False)
class RunState:
    """A run in this supervisor's hands: its latest snapshot id changes with each wait."""

    run_id: str
    snapshot_id: str
    cancelled: bool = False
    slot: _Slot | None = None  # given back once the run is suspended, before its executor is back
    attempt: int | None = None  # the attempt this supervisor runs (a restore continues it)
    beat_answered: bool = True  # the last heartbeat was answered (not refused for load, nor lost)


def run_supervisor(config: SupervisorConfig) -> None:
    async def main() -> None:
        sup = Supervisor(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, sup.stop)
        await sup.run()

    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())
