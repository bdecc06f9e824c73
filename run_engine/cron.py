"""Cron expressions: ``minute hour day-of-month month day-of-week`` (an optional leading seconds
field makes six), with ``*``, lists, ranges, steps, month and weekday names, ``?`` (any: in the
day-of-month and day-of-week fields only, as Quartz-style crons write ``0 0 ? * MON``), and the
macros ``@yearly @monthly @weekly @daily @hourly``. Times are computed in the schedule's IANA
timezone: a wall time that does not exist (spring forward) is skipped, one that happens twice
(fall back) fires once. Day-of-month and day-of-week restrict together when both are given (Vixie
cron: either may match)."""

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


def _field(text: str, lo: int, hi: int, names: dict[str, int] | None = None) -> frozenset[int]:
    values: set[int] = set()
    for part in text.lower().split(","):
        # an empty item is not "*" ("0 , * * *" is not hourly, "/5" not "*/5"); "?" is a whole
        # day-of-month or day-of-week field (Cron.parse), never an item nor another field
        if part == "":
            raise CronError(f"{text!r} has an empty list item")
        if part.startswith("/"):
            raise CronError(f"{text!r}: a step needs a start before it (*/5, 0-30/5, 5/15)")
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

    @classmethod
    def parse(cls, expression: str) -> Cron:
        text = MACROS.get(expression.strip().lower(), expression.strip())
        parts = text.split()
        if len(parts) == 5:
            parts = ["0", *parts]
        if len(parts) != 6:
            raise CronError("a cron expression has 5 fields (minute hour day month weekday), or 6 with seconds first")
        sec, minute, hour, day, month, weekday = parts
        # "?" (Quartz, Trigger.dev) is "*" where it may stand: the whole day-of-month or day-of-week
        day, weekday = ("*" if f == "?" else f for f in (day, weekday))
        weekdays = frozenset(d % 7 for d in _field(weekday, 0, 7, DAYS))  # 7 is Sunday too
        return cls(expression, _field(sec, 0, 59), _field(minute, 0, 59), _field(hour, 0, 23), _field(day, 1, 31),
                   _field(month, 1, 12, MONTHS), weekdays, day == "*", weekday == "*")

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

    def next_after(self, after: datetime, timezone: str = "UTC") -> datetime:
        """The first fire time strictly after ``after`` (aware), as an aware UTC datetime."""
        tz = zone(timezone)
        local = after.astimezone(tz).replace(tzinfo=None, microsecond=0) + timedelta(seconds=1)
        limit = local + timedelta(days=366 * 5)
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
                local += timedelta(seconds=1)
                continue
            aware = local.replace(tzinfo=tz)
            utc = aware.astimezone(UTC)
            # a wall time that does not exist comes back changed from a round trip: skip it
            if utc.astimezone(tz).replace(tzinfo=None) == local and utc > after:
                return utc
            local += timedelta(seconds=1)
        raise CronError(f"{self.expression!r} never fires")


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
