"""Client commands of the CLI: they call the public API (``RUN_ENGINE_API_URL``,
``RUN_ENGINE_API_KEY``) and print tables, or JSON with ``--json``."""

from __future__ import annotations

import functools
import json
import sys
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, TypeVar
from urllib.parse import quote

import httpx
import typer
from rich.console import Console
from rich.errors import NotRenderableError
from rich.markup import escape
from rich.table import Table

from run_engine.sdk.client import BACKOFF_S, MAX_RETRY_AFTER_S, OWN_KEY_TTL, RETRYABLE, TRIES, UNSENT, retry_after

FINAL = {"COMPLETED", "CANCELED", "FAILED", "CRASHED", "SYSTEM_FAILURE", "EXPIRED", "TIMED_OUT"}
NOT_STARTED = {"QUEUED", "DELAYED", "PENDING_VERSION"}
# Piped output is not cut to 80 columns: ids must survive `| grep`.
console = Console(width=None if sys.stdout.isatty() else 240)
err_console = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])
# what reading an answer of another shape than the command expects raises (a field missing, a list
# where an object was expected, a value a table cannot print)
_SHAPE_ERRORS = (KeyError, IndexError, TypeError, AttributeError, NotRenderableError)
_answers: list[tuple[str, str, int, str]] = []  # the command's answers so far: method, URL, status, body


def _reads_answers(command: F) -> F:
    """``command`` with an answer it cannot read (a 200 of another shape) said in one line with exit 1:
    the request, its status and the start of the body, never a traceback."""

    @functools.wraps(command)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _answers.clear()
        try:
            return command(*args, **kwargs)
        except _SHAPE_ERRORS as exc:
            if not _answers:  # not from an answer: the CLI's own bug, with its traceback
                raise
            method, url, status, body = _answers[-1]
            what = f"no field {exc.args[0]!r}" if isinstance(exc, KeyError) and exc.args \
                else f"{type(exc).__name__}: {str(exc)[:100]}"
            body = body[:200] or "an empty body"
            err_console.print(f"{status}: not a run-engine answer from {method} {url} ({what}): {body}",
                              style="red", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None

    return guarded  # type: ignore[return-value]


class _Commands(typer.Typer):
    """A group of client commands, each registered through :func:`_reads_answers`."""

    def command(self, *args: Any, **kwargs: Any) -> Callable[[F], F]:
        register = super().command(*args, **kwargs)

        def decorator(f: F) -> F:
            register(_reads_answers(f))
            return f

        return decorator


runs_app = _Commands(help="Inspect and control runs.", no_args_is_help=True)
queues_app = _Commands(help="Inspect and control queues.", no_args_is_help=True)
dlq_app = _Commands(help="The dead-letter queue.", no_args_is_help=True)
tokens_app = _Commands(help="Waitpoint tokens that runs wait on.", no_args_is_help=True)

AsJson = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
ApiUrl = Annotated[str, typer.Option(envvar="RUN_ENGINE_API_URL", help="run-engine server URL.")]
ApiKey = Annotated[str, typer.Option(envvar="RUN_ENGINE_API_KEY", help="Environment secret key.", show_default=False)]


MAX_PAUSE_S = 5.0  # the longest pause between two tries of a patient call (a poll)
POLL_PATIENCE_S = 60.0  # a poll fails after failing for this long (a failover, a restart: seconds)
_sleep = time.sleep


def _call(url: str, key: str, method: str, path: str, *, safe: bool | None = None, patience_s: float | None = None,
          deadline: float | None = None, hint: str = "", on_retry: Callable[[str], None] | None = None,
          **kwargs: Any) -> Any:
    """One call of the API: its JSON answer, or a line on stderr and exit 1 (2 for a bad ``--api-url``).

    As the SDK does (run_engine.sdk.client), a call is tried again only where that cannot do anything
    twice: when it never reached the server, when it was refused before anything was done (429), and,
    when it is ``safe`` (a GET; a call that does twice what it does once), when its answer was lost or
    was a 5xx or 408. It is tried ``TRIES`` times, 0.5 s, 1 s, 2 s apart, or after the answer's
    ``Retry-After`` (at most 60 s: longer gives up at once); with ``patience_s`` (a poll) until that
    long after its first failure, pauses growing to ``MAX_PAUSE_S``; never past ``deadline``
    (``time.monotonic()``). ``hint`` ends every error line; ``on_retry`` is told each failure tried again."""
    return _send(url, key, method, path, safe=safe, patience_s=patience_s, deadline=deadline, hint=hint,
                 on_retry=on_retry, **kwargs)[0]


def _send(url: str, key: str, method: str, path: str, *, safe: bool | None = None, patience_s: float | None = None,
          deadline: float | None = None, hint: str = "", on_retry: Callable[[str], None] | None = None,
          **kwargs: Any) -> tuple[Any, bool]:
    """:func:`_call`, also saying whether the call was sent again after a try whose outcome is unknown
    (its answer lost, a 5xx: it may have been done)."""
    if not key:
        err_console.print("[red]set RUN_ENGINE_API_KEY (or --api-key) to an environment secret key[/red]")
        raise typer.Exit(2)
    safe = method == "GET" if safe is None else safe
    tail = f"; {hint}" if hint else ""
    tries, first_failure, resent = 0, 0.0, False
    while True:
        tries += 1
        wait: float | None = None
        answer: httpx.Response | None = None
        try:
            r = httpx.request(method, f"{url.rstrip('/')}{path}", headers={"Authorization": f"Bearer {key}"},
                              timeout=30, **kwargs)
        except httpx.InvalidURL as exc:
            err_console.print(f"invalid --api-url {url!r}: {exc}", style="red", markup=False, highlight=False)
            raise typer.Exit(2) from None
        except UNSENT as exc:  # the server saw nothing
            problem = f"cannot reach {url}: {exc}"
        except httpx.TransportError as exc:
            if not safe:
                err_console.print(f"{method} {path}: the answer was lost ({type(exc).__name__}: {exc}); the server "
                                  f"may have done it: look before doing it again{tail}", style="red", markup=False,
                                  highlight=False, soft_wrap=True)
                raise typer.Exit(1) from None
            problem, resent = f"no answer from {url}: {type(exc).__name__}: {exc}", True
        else:
            if r.status_code < 400 or not (r.status_code == 429 or (safe and r.status_code in RETRYABLE)):
                return _read(url, r, tail), resent
            answer, wait = r, retry_after(r)
            problem = f"{r.status_code} {_error_text(r)}"
            resent = resent or r.status_code != 429  # a 429 did nothing; a 5xx may have
        now = time.monotonic()
        first_failure = first_failure or now
        pause = min(BACKOFF_S * 2 ** (tries - 1), MAX_PAUSE_S)
        if wait is not None:
            pause = max(wait, BACKOFF_S / 5)  # as the server asks (a Retry-After of 0 is not a busy loop)
        if wait is not None and wait > MAX_RETRY_AFTER_S:
            why = f"the server asks to wait {wait:.0f} s"
        elif patience_s is None and tries >= TRIES:
            why = f"{tries} tries"
        elif patience_s is not None and now + pause - first_failure > patience_s:
            why = f"{tries} tries over {now - first_failure:.0f} s"
        elif deadline is not None and now + pause > deadline:
            why = f"{tries} tries, out of time"
        else:
            if on_retry is not None:
                on_retry(problem)
            _sleep(pause)
            continue
        if answer is not None:  # said as any error answer is
            _read(url, answer, f" (gave up after {why}){tail}")
        err_console.print(f"{problem} (gave up after {why}){tail}", style="red", markup=False, highlight=False,
                          soft_wrap=True)
        raise typer.Exit(1)


def _error_text(r: httpx.Response) -> str:
    """An error answer's code and message (its start when it is not run-engine's error body)."""
    try:
        error = r.json().get("error")
        return f"{error['code']}: {error['message']}"
    except (ValueError, AttributeError, KeyError, TypeError):
        return r.text[:200]


def _read(url: str, r: httpx.Response, tail: str) -> Any:
    """A final answer: its JSON, or a line on stderr and exit 1 for an error or what is not run-engine's."""
    _answers.append((r.request.method, str(r.request.url), r.status_code, r.text))
    try:
        data = r.json() if r.content else None
    except ValueError:  # a proxy's error page, another program on the port: not a run-engine server
        err_console.print(f"{r.status_code}: not a run-engine answer from {url} "
                          f"({r.headers.get('content-type', 'no content type')}): {r.text[:200]}{tail}",
                          style="red", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    if r.status_code >= 400:
        error = (data or {}).get("error", {}) if isinstance(data, dict) else {}
        error = error if isinstance(error, dict) else {}
        # the message may quote the caller's input (a name, a version): never read as rich markup
        err_console.print(f"{r.status_code} {error.get('code', '')}: {error.get('message', r.text)}{tail}",
                          style="red", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    return data


def _try_call(url: str, key: str, method: str, path: str) -> Any:
    """Like :func:`_call` for a call whose answer is only nice to have: ``None`` instead of an exit."""
    try:
        r = httpx.request(method, f"{url.rstrip('/')}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        return r.json() if r.status_code < 400 and r.content else None
    except (httpx.HTTPError, ValueError):
        return None


def _seg(value: str) -> str:
    """A name or id as one segment of a request path: percent-encoded whole, so that a queue's
    slash, a ``?`` or ``#``, a space or a ``%`` reach the server as the name has them."""
    return quote(value, safe="")


class ResultTable(Table):
    """A table whose text cells are printed as they are (a name such as ``[prod]`` or ``[/]`` is
    not read as rich markup)."""

    def add_row(self, *cells: Any, **kwargs: Any) -> None:
        super().add_row(*(escape(c) if isinstance(c, str) else c for c in cells), **kwargs)


def _emit(data: Any, as_json: bool, table: Table | None = None, text: str | None = None) -> None:
    if as_json:
        typer.echo(json.dumps(data))
    elif table is not None:
        console.print(table)
    elif text is not None:  # it names the caller's input or the server's data: printed as it is
        console.print(text, markup=False, highlight=False, soft_wrap=True)


def _runs_table(runs: list[dict[str, Any]]) -> Table:
    table = ResultTable("id", "task", "status", "attempts", "queue", "created")
    for r in runs:
        table.add_row(r["id"], r["taskIdentifier"], r["status"], str(r["attemptCount"]), r["queue"], r["createdAt"])
    return table


def trigger(
    task: str,
    payload: Annotated[str, typer.Option(help="JSON payload.")] = "null",
    delay: Annotated[str | None, typer.Option(help="Start no sooner than this: 30s, 15m, 2h or an ISO 8601 date.")]
    = None,
    ttl: Annotated[str | None, typer.Option(help="Expire unless started within this (e.g. 10m).")] = None,
    tag: Annotated[list[str] | None, typer.Option(help="A tag (repeat for more, at most 10).")] = None,
    idempotency_key: Annotated[str | None, typer.Option(help="The same key returns the same run.")] = None,
    queue: Annotated[str | None, typer.Option(help="Queue to run in (default: the task's own).")] = None,
    concurrency_key: Annotated[str | None, typer.Option(help="Limit concurrency per this key within the queue.")]
    = None,
    max_attempts: Annotated[int | None, typer.Option(min=1, max=250, help="Attempts before the run fails.")] = None,
    debounce_key: Annotated[str | None, typer.Option(
        help="Debounce: triggers with this key within --debounce-delay make one run.")] = None,
    debounce_delay: Annotated[str, typer.Option(help="Debounce: how long the run waits for more (e.g. 5s).")]
    = "5s",
    debounce_mode: Annotated[str, typer.Option(help="Debounce: leading (the first payload) or trailing (the last).")]
    = "leading",
    debounce_max_delay: Annotated[str | None, typer.Option(help="Debounce: never push the run back past this.")]
    = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the run finishes.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait with --wait.")] = 600,
    api_url: ApiUrl = "http://127.0.0.1:3030", api_key: ApiKey = "", as_json: AsJson = False,
) -> None:
    """Trigger a run of TASK."""
    try:
        body = json.loads(payload)
    except json.JSONDecodeError as exc:
        err_console.print(f"[red]--payload is not JSON: {exc}[/red]")
        raise typer.Exit(2) from None
    # without a key of the caller's, one of the call's own (as the SDK's): a try whose answer was lost
    # is sent again, and finds the run it made instead of making another
    own = idempotency_key is None
    given: dict[str, Any] = {"delay": delay, "ttl": ttl, "tags": tag or None,
                             "idempotencyKey": f"cli:{uuid.uuid4().hex}" if own else idempotency_key,
                             "queue": queue, "concurrencyKey": concurrency_key, "maxAttempts": max_attempts}
    options = {k: v for k, v in given.items() if v is not None}
    if own:  # kept for the call's tries only: retention keeps a run as long as its key holds
        options["idempotencyKeyTTL"] = OWN_KEY_TTL
    if debounce_key is not None:
        options["debounce"] = {"key": debounce_key, "delay": debounce_delay, "mode": debounce_mode,
                               **({"maxDelay": debounce_max_delay} if debounce_max_delay else {})}
    created, resent = _send(api_url, api_key, "POST", f"/api/v1/tasks/{_seg(task)}/trigger", safe=True,
                            json={"payload": body, "options": options})
    if own and resent and "debounce" not in options:
        created["isCached"] = False  # found by the call's own key: the run this call made
    if not wait:
        _emit(created, as_json, text=f"triggered {created['id']}")
        return
    deadline = time.monotonic() + timeout
    started = time.monotonic()
    why, asked, pause = "", 0.0, 0.1
    hint = f"{created['id']} was triggered (`run-engine runs get {created['id']}` shows it)"
    with console.status(f"waiting for {created['id']}…", spinner="dots") as status:
        while True:
            # a failover or a restart of the server is waited out (POLL_PATIENCE_S), the run goes on meanwhile
            run = _call(api_url, api_key, "GET", f"/api/v3/runs/{_seg(created['id'])}", patience_s=POLL_PATIENCE_S,
                        deadline=deadline, hint=hint,
                        on_retry=lambda problem: status.update(f"{created['id']}: {escape(problem)}; trying again"))
            if run["status"] in FINAL:
                break
            now = time.monotonic()
            if run["status"] in NOT_STARTED and now - started > 2 and now - asked > 5:
                # not started after a while: say why (no deployment has the task, a paused queue, a limit…)
                asked = now
                why = _why(_try_call(api_url, api_key, "GET", f"/api/v1/runs/{_seg(created['id'])}/explain"))
            elif run["status"] not in NOT_STARTED:
                why = ""
            status.update(f"{created['id']}: {run['status']}" + (f" ({why})" if why else ""))
            if now > deadline:
                err_console.print(f"[yellow]{created['id']} still {run['status']} after {timeout:g}s"
                                  + (f": {why}" if why else "") + "[/yellow]", soft_wrap=True)
                raise typer.Exit(1)
            time.sleep(pause)
            pause = min(pause * 1.5, 2.0)  # back off: a long wait polls a few times a minute, not 5 a second
    if as_json:
        _emit(run, as_json)
    else:
        console.print(run_view(run), soft_wrap=True, highlight=False)
    if run["status"] != "COMPLETED":
        raise typer.Exit(1)


def _why(explained: Any) -> str:
    """What an explain answers, in a line ("" when it answers nothing readable: it is only nice to have)."""
    try:
        return str(explained.get("summary") or "; ".join(str(r["message"]) for r in explained.get("reasons", [])))
    except _SHAPE_ERRORS:
        return ""


@runs_app.command("list")
def runs_list(
    status: Annotated[str | None, typer.Option(help="Comma-separated statuses.")] = None,
    task: Annotated[str | None, typer.Option(help="Comma-separated task ids.")] = None,
    tag: Annotated[str | None, typer.Option(help="Comma-separated tags.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=100)] = 25,
    api_url: ApiUrl = "http://127.0.0.1:3030", api_key: ApiKey = "", as_json: AsJson = False,
) -> None:
    """List runs, newest first."""
    params = {"page[size]": str(limit)}
    for name, value in (("status", status), ("taskIdentifier", task), ("tag", tag)):
        if value:
            params[f"filter[{name}]"] = value
    data = _call(api_url, api_key, "GET", "/api/v1/runs", params=params)
    _emit(data, as_json, table=_runs_table(data["data"]))


@runs_app.command("get")
def runs_get(run_id: str, api_url: ApiUrl = "http://127.0.0.1:3030", api_key: ApiKey = "",
             as_json: AsJson = False) -> None:
    """Show one run: status, timeline, payload, output or the error with its stack (--json: the run object)."""
    run = _call(api_url, api_key, "GET", f"/api/v3/runs/{_seg(run_id)}")
    view = run_view(run)  # also with --json: a run object, or an error
    if as_json:
        _emit(run, as_json)
        return
    console.print(view, soft_wrap=True, highlight=False)


def run_view(run: dict[str, Any]) -> str:
    """A run as a person reads it (rich markup; values escaped)."""
    from rich.markup import escape

    colour = {"COMPLETED": "green", "CANCELED": "yellow"}.get(run["status"], "red" if run.get("isFailed") else "cyan")
    lines = [f"[bold]{escape(run['taskIdentifier'])}[/bold]  [{colour}]{run['status']}[/{colour}]  {run['id']}",
             f"  queue     {escape(run['queue'])}",
             f"  attempts  {run['attemptCount']}" + (f" of {run['maxAttempts']}" if run.get("maxAttempts") else "")]
    if run.get("tags"):
        lines.append("  tags      " + ", ".join(escape(t) for t in run["tags"]))
    for key, label in (("parentRunId", "parent"), ("batchId", "batch"), ("idempotencyKey", "idempotency")):
        if run.get(key):
            lines.append(f"  {label:<9} {escape(str(run[key]))}")
    lines.append("timeline")
    for key, label in (("createdAt", "created"), ("delayedUntil", "delayed to"), ("startedAt", "started"),
                       ("finishedAt", "finished"), ("expiredAt", "expired")):
        if run.get(key):
            lines.append(f"  {label:<10} {run[key]}")
    if run.get("durationMs"):
        lines.append(f"  {'took':<10} {run['durationMs']} ms")
    lines += ["payload", _indented(run.get("payload"))]
    if run.get("output") is not None:
        lines += ["output", _indented(run["output"])]
    error = run.get("error")
    if error:
        head = " ".join(str(error[k]) for k in ("name", "type") if error.get(k))[:200]
        lines += [f"[red]error[/red]  {escape(head)}: {escape(str(error.get('message', '')))}"]
        stack = error.get("stackTrace") or error.get("stack")
        if stack:
            lines += [escape("  " + str(stack).rstrip().replace("\n", "\n  "))]
    if run.get("children"):
        lines += ["children"] + [f"  {c}" for c in run["children"]]
    return "\n".join(lines)


def _indented(value: Any) -> str:
    from rich.markup import escape

    return escape("  " + json.dumps(value, indent=2, ensure_ascii=False).replace("\n", "\n  "))


@runs_app.command("cancel")
def runs_cancel(run_id: str, api_url: ApiUrl = "http://127.0.0.1:3030", api_key: ApiKey = "",
                as_json: AsJson = False) -> None:
    """Cancel a run (no-op when it already finished)."""
    _emit(_call(api_url, api_key, "POST", f"/api/v2/runs/{_seg(run_id)}/cancel", safe=True), as_json,
          text=f"cancelled {run_id}")


@runs_app.command("replay")
def runs_replay(run_id: str, api_url: ApiUrl = "http://127.0.0.1:3030", api_key: ApiKey = "",
                as_json: AsJson = False) -> None:
    """Trigger a new run with the same task, payload and options."""
    data = _call(api_url, api_key, "POST", f"/api/v1/runs/{_seg(run_id)}/replay")
    _emit(data, as_json, text=f"replayed as {data['id']}")


@queues_app.command("list")
def queues_list(api_url: ApiUrl = "http://127.0.0.1:3030", api_key: ApiKey = "", as_json: AsJson = False) -> None:
    """List queues with their running and queued counts."""
    data = _call(api_url, api_key, "GET", "/api/v1/queues")
    table = ResultTable("name", "type", "running", "queued", "limit", "paused")
    for q in data["data"]:
        table.add_row(q["name"], q["type"], str(q["running"]), str(q["queued"]),
                      "-" if q["concurrencyLimit"] is None else str(q["concurrencyLimit"]),
                      "yes" if q["paused"] else "")
    _emit(data, as_json, table=table)


def _pause(name: str, action: str, api_url: str, api_key: str, as_json: bool) -> None:
    q = _call(api_url, api_key, "POST", f"/api/v1/queues/{_seg(name)}/pause", json={"action": action})
    _emit(q, as_json, text=f"{name}: {'paused' if q['paused'] else 'running'}")


@queues_app.command("pause")
def queues_pause(name: str, api_url: ApiUrl = "http://127.0.0.1:3030", api_key: ApiKey = "",
                 as_json: AsJson = False) -> None:
    """Pause a queue: its runs stay queued."""
    _pause(name, "pause", api_url, api_key, as_json)


@queues_app.command("resume")
def queues_resume(name: str, api_url: ApiUrl = "http://127.0.0.1:3030", api_key: ApiKey = "",
                  as_json: AsJson = False) -> None:
    """Resume a paused queue."""
    _pause(name, "resume", api_url, api_key, as_json)


@dlq_app.command("list")
def dlq_list(api_url: ApiUrl = "http://127.0.0.1:3030", api_key: ApiKey = "", as_json: AsJson = False) -> None:
    """Dead-lettered runs with the reason."""
    data = _call(api_url, api_key, "GET", "/api/v1/dlq", params={"page[size]": "100"})
    table = ResultTable("run", "task", "queue", "deliveries", "dead at", "reason")
    for e in data["data"]:
        table.add_row(e["run"]["id"], e["run"]["taskIdentifier"], e["run"]["queue"], str(e["deliveries"]),
                      e["deadAt"], e["reason"])
    _emit(data, as_json, table=table)


@dlq_app.command("redrive")
def dlq_redrive(
    run_id: Annotated[str | None, typer.Argument(help="One run; omit with --all.")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Redrive every matching run.")] = False,
    task: Annotated[str | None, typer.Option(help="With --all: only this task.")] = None,
    queue: Annotated[str | None, typer.Option(help="With --all: only this queue.")] = None,
    api_url: ApiUrl = "http://127.0.0.1:3030", api_key: ApiKey = "", as_json: AsJson = False,
) -> None:
    """Put dead-lettered runs back in their queues."""
    if run_id and not all_:
        _emit(_call(api_url, api_key, "POST", f"/api/v1/dlq/{_seg(run_id)}/redrive"), as_json,
              text=f"redriven {run_id}")
    elif all_ and not run_id:
        body: dict[str, Any] = {k: v for k, v in {"taskIdentifier": task, "queue": queue}.items() if v}
        total = 0
        while True:  # the server goes through a bounded part of the DLQ a call
            data = _call(api_url, api_key, "POST", "/api/v1/dlq/redrive", json=body)
            total += data["redriven"]
            if not data.get("next"):
                break
            body["after"] = data["next"]
            if not as_json:
                err_console.print(f"redriven {total} runs so far ...")
        _emit({"redriven": total}, as_json, text=f"redriven {total} runs")
    else:
        err_console.print("[red]give a run id or --all[/red]")
        raise typer.Exit(2)


@tokens_app.command("create")
def tokens_create(
    timeout: Annotated[str | None, typer.Option(help="Time out after this long (e.g. 30s, 1h).")] = None,
    idempotency_key: Annotated[str | None, typer.Option(help="Same key, same token (until its TTL).")] = None,
    idempotency_key_ttl: Annotated[str | None, typer.Option(help="How long the key holds (default 30d).")] = None,
    tag: Annotated[list[str] | None, typer.Option("--tag", help="A tag (repeatable).")] = None,
    api_url: ApiUrl = "http://127.0.0.1:3030", api_key: ApiKey = "", as_json: AsJson = False,
) -> None:
    """Create a token; prints its id and the callback URL an outside system can POST to."""
    body = {k: v for k, v in {"timeout": timeout, "idempotencyKey": idempotency_key,
                               "idempotencyKeyTTL": idempotency_key_ttl, "tags": tag}.items() if v is not None}
    created = _call(api_url, api_key, "POST", "/api/v1/waitpoints/tokens", json=body)
    cached = " (existing token for this idempotency key)" if created["isCached"] else ""
    _emit(created, as_json, text=f"token {created['id']}{cached}\ncallback URL: {created['url']}")


@tokens_app.command("complete")
def tokens_complete(
    token_id: str,
    data: Annotated[str, typer.Option(help="JSON output the waiting runs receive.")] = "null",
    api_url: ApiUrl = "http://127.0.0.1:3030", api_key: ApiKey = "", as_json: AsJson = False,
) -> None:
    """Complete a token: every run waiting on it continues with DATA."""
    try:
        output = json.loads(data)
    except json.JSONDecodeError as exc:
        err_console.print(f"[red]--data is not JSON: {exc}[/red]")
        raise typer.Exit(2) from None
    result = _call(api_url, api_key, "POST", f"/api/v1/waitpoints/tokens/{_seg(token_id)}/complete",
                   safe=True, json={"data": output})  # the first completion wins: twice is once
    _emit(result, as_json, text=f"completed {token_id}")


@tokens_app.command("get")
def tokens_get(token_id: str, api_url: ApiUrl = "http://127.0.0.1:3030", api_key: ApiKey = "",
               as_json: AsJson = False) -> None:
    """Show a token: status (WAITING, COMPLETED, TIMED_OUT) and output."""
    token = _call(api_url, api_key, "GET", f"/api/v1/waitpoints/tokens/{_seg(token_id)}")
    table = ResultTable("field", "value")
    for key in ("id", "status", "output", "completedAt", "timeoutAt", "tags", "idempotencyKey", "url"):
        if key in ("id", "status") or key in token:  # every token has these
            table.add_row(key, json.dumps(token[key]) if key in ("output", "tags") else str(token[key]))
    _emit(token, as_json, table=table)


def worker_groups_list(api_url: ApiUrl = "http://127.0.0.1:3030", api_key: ApiKey = "",
                       as_json: AsJson = False) -> None:
    """List the worker groups this environment's runs may be sent to, with their instances."""
    data = _call(api_url, api_key, "GET", "/api/v1/worker-groups")
    table = ResultTable("name", "default", "instances", "last heartbeat")
    for g in data["data"]:
        last = max((i["lastHeartbeatAt"] or "" for i in g["instances"]), default="") or "-"
        table.add_row(g["name"] + (" (shared)" if g["shared"] else ""), "yes" if g["isDefault"] else "",
                      str(len(g["instances"])), last)
    _emit(data, as_json, table=table)


def promote(
    version: Annotated[str, typer.Argument(help="The deployment version to make current (as its connect gave it).")],
    worker_group: Annotated[str | None, typer.Option(
        help="Only in this worker group (a name); default: every group of the environment that has the version.")]
    = None,
    api_url: ApiUrl = "http://127.0.0.1:3030", api_key: ApiKey = "", as_json: AsJson = False,
) -> None:
    """Make a deployment version current again (a rollback).

    Triggers take its tasks' settings, its queues the limits it declared, its crons are the
    environment's, and runs that waited for a version with their task are enqueued. It stays current
    when workers of newer versions connect again; a new version connecting makes that one current."""
    body = {"workerGroup": worker_group} if worker_group is not None else {}
    data = _call(api_url, api_key, "POST", f"/api/v1/deployments/{_seg(version)}/promote", json=body)
    lines = []
    for d in data["deployments"]:
        if d["alreadyCurrent"]:
            lines.append(f"version {d['version']} was current already in worker group {d['workerGroupId']} "
                         f"({d['id']})")
        else:
            waited = f"; {d['pendingRunsEnqueued']} waiting runs enqueued" if d["pendingRunsEnqueued"] else ""
            lines.append(f"version {d['version']} is current in worker group {d['workerGroupId']} ({d['id']}){waited}")
    if as_json:
        _emit(data, as_json)
    else:  # a version is the user's text: printed as it is, never read as rich markup
        console.print("\n".join(lines), markup=False, highlight=False)


def register(app: typer.Typer) -> None:
    app.command()(_reads_answers(trigger))
    app.command()(_reads_answers(promote))
    app.add_typer(runs_app, name="runs")
    app.add_typer(queues_app, name="queues")
    app.add_typer(dlq_app, name="dlq")
    app.add_typer(tokens_app, name="tokens")


def register_worker_groups(group: typer.Typer) -> None:
    group.command("list")(_reads_answers(worker_groups_list))
