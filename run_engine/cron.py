"""Cron expressions: ``minute hour day-of-month month day-of-week`` (an optional leading seconds
field makes six), with ``*``, lists, ranges, steps, month and weekday names, ``?`` (any: in the
day-of-month and day-of-week fields only, as Quartz-style crons write ``0 0 ? * MON``), and the
macros ``@yearly @monthly @weekly @daily @hourly``. Day-of-month and day-of-week restrict together
when both are given (Vixie cron: either may match).

An empty list item (``0 , * * *``, ``1,,2``) or a step with nothing before it (``/5``) is refused;
``lenient=True`` reads them as the versions before this rule did (an empty item is ``*``, ``/5`` is
``*/5``), for the crons those versions accepted and stored (a schedule made through the API, a
task's declared cron): they keep firing as they did (``Cron.read_leniently`` tells them apart).

Times are computed in the schedule's IANA timezone, across daylight saving changes after Vixie
cron and cronie. A job whose hour field takes every hour (``*``, ``*/1``, ``0-23``: it runs at fixed
minutes every hour) goes by elapsed time: it fires at each instant whose wall time matches, so at
both occurrences of a wall time a fall back repeats, and not at all at wall times a spring forward
skips. A job at fixed hours fires once a matching wall time: at its first occurrence when a fall
back repeats it, and at the first instant after the gap (03:00 for 02:30 in New York) when a
spring forward skips it (once, however many of its times the gap holds)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

MACROS = {"@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *", "@weekly": "0 0 * * 0",
          "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@hourly": "0 * * * *"}
MONTHS = {m: i + 1 for i, m in enumerate("jan feb mar apr may jun jul aug sep oct nov dec".split())}
DAYS = {d: i for i, d in enumerate("sun mon tue wed thu fri sat".split())}


class CronError(ValueError):
    pass


def _field(text: str, lo: int, hi: int, names: dict[str, int] | None = None, lenient: bool = False) -> frozenset[int]:
    values: set[int] = set()
    for part in text.lower().split(","):
        # an empty item is not "*" ("0 , * * *" is not hourly, "/5" not "*/5"), but read leniently;
        # "?" is a whole day-of-month or day-of-week field (Cron.parse), never an item nor another field
        if _loose(part):
            if not lenient:
                if part == "":
                    raise CronError(f"{text!r} has an empty list item")
                raise CronError(f"{text!r}: a step needs a start before it (*/5, 0-30/5, 5/15)")
            part = "*" + part
        if "?" in part:
            raise CronError("'?' (any) is only a whole day-of-month or day-of-week field")
        step = 1
        if "/" in part:
            part, step_text = part.split("/", 1)
            if not (step_text.isascii() and step_text.isdigit()) or int(step_text) == 0:
                raise CronError(f"bad step in {text!r}")
            step = int(step_text)
        if part == "*":
            start, end = lo, hi
        elif "-" in part:
            a, b = part.split("-", 1)
            start, end = _value(a, names), _value(b, names)
        else:
            start = _value(part, names)
            end = hi if step > 1 else start
        if not (lo <= start <= hi and lo <= end <= hi) or start > end:
            raise CronError(f"{text!r} is outside {lo}-{hi}")
        values.update(range(start, end + 1, step))
    return frozenset(values)


def _loose(part: str) -> bool:
    """An empty list item, or a step with nothing before it: ``*`` to the versions before."""
    return part == "" or part.startswith("/")


def _value(text: str, names: dict[str, int] | None) -> int:
    if names and text in names:
        return names[text]
    if not (text.isascii() and text.isdigit()):
        raise CronError(f"{text!r} is not a number")
    return int(text)


@dataclass(frozen=True, slots=True)
class Cron:
    expression: str
    seconds: frozenset[int]
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    any_day: bool
    any_weekday: bool
    #: parsed with ``lenient`` and only valid so (an empty list item or a bare step read as ``*``)
    read_leniently: bool = False

    @classmethod
    def parse(cls, expression: str, *, lenient: bool = False) -> Cron:
        """``lenient``: an empty list item is ``*`` and a bare step ``/n`` is ``*/n``, as the versions
        before read them (for crons they accepted and stored); strict otherwise."""
        text = MACROS.get(expression.strip().lower(), expression.strip())
        parts = text.split()
        if len(parts) == 5:
            parts = ["0", *parts]
        if len(parts) != 6:
            raise CronError("a cron expression has 5 fields (minute hour day month weekday), or 6 with seconds first")
        sec, minute, hour, day, month, weekday = parts
        # "?" (Quartz, Trigger.dev) is "*" where it may stand: the whole day-of-month or day-of-week
        day, weekday = ("*" if f == "?" else f for f in (day, weekday))
        weekdays = frozenset(d % 7 for d in _field(weekday, 0, 7, DAYS, lenient))  # 7 is Sunday too
        return cls(expression, _field(sec, 0, 59, None, lenient), _field(minute, 0, 59, None, lenient),
                   _field(hour, 0, 23, None, lenient), _field(day, 1, 31, None, lenient),
                   _field(month, 1, 12, MONTHS, lenient), weekdays, day == "*", weekday == "*",
                   lenient and any(_loose(p) for f in parts for p in f.split(",")))

    def _day_matches(self, d: datetime) -> bool:
        dom = d.day in self.days
        dow = (d.isoweekday() % 7) in self.weekdays
        if self.any_day and self.any_weekday:
            return True
        if self.any_day:
            return dow
        if self.any_weekday:
            return dom
        return dom or dow

    def no_day_matches(self) -> bool:
        """Whether the fields alone rule out every day, in every year: a day-of-month that
        restricts alone (day-of-week ``*``) whose smallest day is past the longest of the months
        allowed (February's 29), as ``0 0 30 2 *`` or ``0 0 31 4,6 *``. Given day-of-week too, a
        day matches either (Vixie cron), and every month has every weekday."""
        return (not self.any_day and self.any_weekday
                and min(self.days) > max(_MONTH_DAYS[m - 1] for m in self.months))

    def next_after(self, after: datetime, timezone: str = "UTC") -> datetime:
        """The first fire time strictly after ``after`` (aware), as an aware UTC datetime (the
        daylight saving rules are the module's). Looks 5 years ahead at most. An expression no
        day can match (:meth:`no_day_matches`) is refused without the search, as the search would
        refuse it after 5 years of days (2 to 30 ms of CPU a request); the search judges the rest
        (``0 0 29 2 *`` fires in a leap year, or not within 5 years: from March 2097 to 2104)."""
        tz = zone(timezone)
        every_hour = self.hours == _EVERY_HOUR
        base = after.astimezone(UTC).replace(tzinfo=None, microsecond=0)
        if not _EARLIEST <= base < _LATEST:
            raise CronError(f"{after.isoformat()} is out of the range of dates cron works with")
        if self.no_day_matches():
            raise CronError(f"{self.expression!r} never fires")
        first = base + _SECOND  # the first candidate
        horizon = min(first + _HORIZON, _LATEST)
        # Instants and wall times are naive (UTC, local). Between two changes of the zone's offset,
        # wall time is instant + offset: walk the wall times of one such stretch at a time. Start
        # two days back so that a fixed-hour job knows the wall times already passed (a wall time
        # repeated by a fall back in the last day had its first occurrence then).
        at = first - _PAST
        passed = datetime.min  # fixed hours: the wall times the stretches before reached (fired once)
        while at < horizon:
            offset = _offset(tz, at)
            start = max(at, first) + offset
            if not every_hour:
                start = max(start, passed)
            wall = self._first_match(start, horizon + offset)
            candidate = horizon if wall is None else wall - offset
            change = _next_change(tz, at, offset, candidate)
            if change is None:
                if wall is None:
                    break
                return candidate.replace(tzinfo=UTC)
            # the offset changes before `candidate` (at which `wall` is not the wall time): no match
            # up to `change`, where the next stretch begins
            later = _offset(tz, change)
            if later > offset and not every_hour and change >= first \
                    and self._first_match(max(change + offset, passed), change + later) is not None:
                return change.replace(tzinfo=UTC)  # fixed hours: a wall time the gap skips fires after it
            passed = max(passed, change + offset)
            at = change
        raise CronError(f"{self.expression!r} never fires")

    def _first_match(self, local: datetime, limit: datetime) -> datetime | None:
        """The first wall time from ``local`` (included) and before ``limit`` that the fields match."""
        while local < limit:
            if local.month not in self.months:
                local = (local.replace(day=1, hour=0, minute=0, second=0) + timedelta(days=32)).replace(day=1)
                continue
            if not self._day_matches(local):
                local = local.replace(hour=0, minute=0, second=0) + timedelta(days=1)
                continue
            if local.hour not in self.hours:
                local = local.replace(minute=0, second=0) + timedelta(hours=1)
                continue
            if local.minute not in self.minutes:
                local = local.replace(second=0) + timedelta(minutes=1)
                continue
            if local.second not in self.seconds:
                local += _SECOND
                continue
            return local
        return None


_EVERY_HOUR = frozenset(range(24))
#: the most days each month has (February's in a leap year)
_MONTH_DAYS = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)
_SECOND = timedelta(seconds=1)
_DAY = timedelta(days=1)
_PAST = 2 * _DAY  # more than any offset change goes back
_HORIZON = timedelta(days=366 * 5)
_EARLIEST = datetime(1, 1, 1) + 2 * _PAST
_LATEST = datetime(9999, 11, 1)  # a month's step and a day's offset past it still fit in a datetime


def _offset(tz: ZoneInfo, instant: datetime) -> timedelta:
    """The zone's UTC offset at the (naive UTC) instant."""
    return tz.fromutc(instant.replace(tzinfo=tz)).utcoffset() or timedelta()


def _next_change(tz: ZoneInfo, at: datetime, offset: timedelta, until: datetime) -> datetime | None:
    """The first instant in ``(at, until]`` whose offset is not ``offset`` (``at``'s), to the second;
    None when there is none. Probes a day at a time: since 1970 tzdata's offset changes are a week
    apart at least, so none is missed (two in a day that cancel out would be)."""
    lo = at
    while lo < until:
        hi = min(lo + _DAY, until)
        if _offset(tz, hi) != offset:
            while hi - lo > _SECOND:  # the offset is `offset` at lo, another at hi
                mid = lo + timedelta(seconds=(hi - lo) // _SECOND // 2)
                lo, hi = (mid, hi) if _offset(tz, mid) == offset else (lo, mid)
            return hi
        lo = hi
    return None


#: names the host's zone files have but that are not IANA zones, or that mean another thing on
#: another host: a schedule made on one process must tick the same on every other
_NOT_ZONES = frozenset({"localtime", "Factory", "posixrules"})


@functools.cache
def _zones() -> frozenset[str]:
    """The IANA zone names (the ``tzdata`` package's at least, whatever the host has), without the
    leap-second ``right/`` and ``posix/`` copies."""
    return frozenset(n for n in available_timezones()
                     if n not in _NOT_ZONES and not n.startswith(("right/", "posix/")))


def zone(name: str) -> ZoneInfo:
    if name not in _zones():
        raise CronError(f"unknown timezone {name!r} (use an IANA name like 'Europe/Paris')")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise CronError(f"unknown timezone {name!r} (use an IANA name like 'Europe/Paris')") from None
