"""Cron expressions: fields, names, steps, macros, timezones and DST."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from run_engine.cron import Cron, CronError

NY = "America/New_York"  # 2024-11-03 01:00-01:59 happens twice; 2024-03-10 02:00-02:59 does not exist


def nxt(expr: str, after: str, tz: str = "UTC") -> str:
    return Cron.parse(expr).next_after(datetime.fromisoformat(after), tz).isoformat()


def test_common_expressions() -> None:
    assert nxt("*/15 * * * *", "2026-01-01T10:07:00+00:00") == "2026-01-01T10:15:00+00:00"
    assert nxt("0 9 * * mon-fri", "2026-01-02T09:00:00+00:00") == "2026-01-05T09:00:00+00:00"  # Fri → Mon
    assert nxt("30 2 1 jan,jul *", "2026-01-01T03:00:00+00:00") == "2026-07-01T02:30:00+00:00"
    assert nxt("@hourly", "2026-01-01T10:00:00+00:00") == "2026-01-01T11:00:00+00:00"
    assert nxt("@daily", "2026-12-31T23:59:59+00:00") == "2027-01-01T00:00:00+00:00"
    assert nxt("0 0 29 2 *", "2026-03-01T00:00:00+00:00") == "2028-02-29T00:00:00+00:00"
    assert nxt("*/2 * * * * *", "2026-01-01T00:00:01+00:00") == "2026-01-01T00:00:02+00:00"  # seconds first
    # day-of-month and day-of-week both given: either matches (Vixie cron)
    assert nxt("0 0 13 * fri", "2026-02-01T00:00:00+00:00") == "2026-02-06T00:00:00+00:00"
    assert nxt("0 0 * * 7", "2026-01-01T00:00:00+00:00") == "2026-01-04T00:00:00+00:00"  # 7 is Sunday


def test_timezones_and_daylight_saving() -> None:
    assert nxt("0 9 * * *", "2026-06-01T00:00:00+00:00", "Europe/Paris") == "2026-06-01T07:00:00+00:00"
    # 02:30 does not exist in Paris on 2026-03-29: it fires as the gap ends, at 03:00 CEST
    assert nxt("30 2 * * *", "2026-03-28T02:00:00+00:00", "Europe/Paris") == "2026-03-29T01:00:00+00:00"
    assert nxt("30 2 * * *", "2026-03-29T01:00:00+00:00", "Europe/Paris") == "2026-03-30T00:30:00+00:00"
    # 02:30 happens twice on 2026-10-25: it fires once
    first = Cron.parse("30 2 * * *").next_after(datetime(2026, 10, 24, 12, tzinfo=UTC), "Europe/Paris")
    second = Cron.parse("30 2 * * *").next_after(first, "Europe/Paris")
    assert first.isoformat() == "2026-10-25T00:30:00+00:00" and second.date().isoformat() == "2026-10-26"


def ticks(expr: str, tz: str, start: datetime, until: datetime) -> list[datetime]:
    out, at, c = [], start, Cron.parse(expr)
    while (at := c.next_after(at, tz)) < until:
        out.append(at)
    return out


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


def test_a_job_every_hour_goes_by_elapsed_time_across_daylight_saving() -> None:
    """Vixie cron / cronie: a job whose hour field takes every hour fires at both occurrences of the
    wall times a fall back repeats, and skips those a spring forward leaves out."""
    quarter = ticks("*/15 * * * *", NY, utc(2024, 11, 3, 4, 59), utc(2024, 11, 3, 7, 0))  # 00:59 EDT..02:00 EST
    assert quarter == [utc(2024, 11, 3, 5, 0) + timedelta(minutes=15 * i) for i in range(8)]  # 01:00 EDT..01:45 EST
    hourly = ticks("0 * * * *", NY, utc(2024, 11, 3, 3, 30), utc(2024, 11, 3, 8, 30))
    assert [t.hour for t in hourly] == [4, 5, 6, 7, 8]  # 00:00 EDT, 01:00 EDT, 01:00 EST, 02:00 EST, 03:00 EST
    assert ticks("0 0-23 * * *", NY, utc(2024, 11, 3, 3, 30), utc(2024, 11, 3, 8, 30)) == hourly  # every hour too
    # spring forward: 01:45 EST, then 03:00 EDT (02:xx does not exist), a quarter of an hour later
    assert ticks("*/15 * * * *", NY, utc(2024, 3, 10, 6, 40), utc(2024, 3, 10, 7, 20)) == [
        utc(2024, 3, 10, 6, 45), utc(2024, 3, 10, 7, 0), utc(2024, 3, 10, 7, 15)]
    # seconds too: "every second" through the repeated hour is 7200 ticks, not 3600
    assert len(ticks("* * * * * *", NY, utc(2024, 11, 3, 4, 59, 59), utc(2024, 11, 3, 7, 0))) == 7200


def test_a_job_at_fixed_hours_fires_once_a_day_across_daylight_saving() -> None:
    # fall back: 01:30 happens twice, it fires at the first (EDT) only
    got = ticks("30 1 * * *", NY, utc(2024, 11, 2, 12), utc(2024, 11, 5, 0))
    assert got == [utc(2024, 11, 3, 5, 30), utc(2024, 11, 4, 6, 30)]
    # even when asked from inside the second occurrence (01:10 EST): it ran at 01:30 EDT already
    assert Cron.parse("30 1 * * *").next_after(utc(2024, 11, 3, 6, 10), NY) == utc(2024, 11, 4, 6, 30)
    # spring forward: 02:30 does not exist on 2024-03-10: it fires right after the gap, at 03:00 EDT
    got = ticks("30 2 * * *", NY, utc(2024, 3, 9, 12), utc(2024, 3, 12, 12))
    assert got == [utc(2024, 3, 10, 7, 0), utc(2024, 3, 11, 6, 30), utc(2024, 3, 12, 6, 30)]
    # once, however many of its times the gap holds, and once with a time right after the gap
    for expr in ("0,30 2 * * *", "* 2 * * *", "0 2,3 * * *", "30 30 2 * * *"):
        assert ticks(expr, NY, utc(2024, 3, 10, 6), utc(2024, 3, 10, 7, 59)) == [utc(2024, 3, 10, 7, 0)], expr
    assert ticks("30 2,3 * * *", NY, utc(2024, 3, 10, 6), utc(2024, 3, 10, 8)) == [
        utc(2024, 3, 10, 7, 0), utc(2024, 3, 10, 7, 30)]
    # Apia skipped 2011-12-30 whole: noon that day fires as the gap ends (00:00 on the 31st)
    got = ticks("0 12 * * *", "Pacific/Apia", utc(2011, 12, 29), utc(2011, 12, 31))
    assert [t.astimezone(ZoneInfo("Pacific/Apia")).isoformat() for t in got] == [
        "2011-12-29T12:00:00-10:00", "2011-12-31T00:00:00+14:00", "2011-12-31T12:00:00+14:00"]


def _reference(expr: str, tz: str, start: datetime, until: datetime) -> list[datetime]:
    """The ticks by their definition, minute by minute: a job every hour fires at each instant whose
    wall time matches; one at fixed hours at the first instant of each matching wall time, and at
    the end of a gap that skips any."""
    c, z, out = Cron.parse(expr), ZoneInfo(tz), []
    every_hour = c.hours == frozenset(range(24))

    def matches(w: datetime) -> bool:
        return w.minute in c.minutes and w.hour in c.hours and w.month in c.months and c._day_matches(w)

    reached: datetime | None = None
    at = start
    while at < until:
        wall = at.astimezone(z).replace(tzinfo=None)
        if reached is not None and wall > reached + timedelta(minutes=1) and not every_hour:  # a gap
            w = reached + timedelta(minutes=1)
            while w < wall and not matches(w):
                w += timedelta(minutes=1)
            if w < wall:
                out.append(at)
        if matches(wall) and (every_hour or reached is None or wall > reached) and at not in out[-1:]:
            out.append(at)
        reached = wall if reached is None else max(reached, wall)
        at += timedelta(minutes=1)
    return out


@pytest.mark.parametrize("tz,day", [(NY, "2024-11-03"), (NY, "2024-03-10"), ("Australia/Lord_Howe", "2024-04-07"),
                                    ("Australia/Lord_Howe", "2024-10-06"), ("Antarctica/Casey", "2012-02-22"),
                                    ("Pacific/Apia", "2011-12-30"), ("America/Santiago", "2024-09-08")])
def test_ticks_across_offset_changes_are_those_of_the_definition(tz: str, day: str) -> None:
    """Lord Howe moves half an hour, Casey went back three hours, Apia skipped a day, Santiago's
    gap takes midnight."""
    start = datetime.fromisoformat(day).replace(tzinfo=UTC) - timedelta(hours=30)
    until = start + timedelta(hours=60)
    for expr in ("*/20 * * * *", "0 * * * *", "30 2 * * *", "45 1 * * *", "0,30 2 * * *", "0 0 * * *",
                 "15 0-3 * * *", "0 12 * * *", "10 */2 * * *"):
        assert ticks(expr, tz, start - timedelta(seconds=1), until) == _reference(expr, tz, start, until), expr


@pytest.mark.parametrize("expr,tz", [("* * * * * *", NY), ("0 0 31 2 *", NY), ("0 0 30 2 *", "Asia/Gaza"),
                                     ("59 59 23 31 12 *", "Pacific/Apia"), ("* * 10 3 *", NY),
                                     ("59 * * * * *", "Australia/Lord_Howe"), ("0 0 29 2 1", "Antarctica/Casey"),
                                     ("30 2 10 3 *", NY)])
def test_the_next_tick_is_worked_out_or_refused(expr: str, tz: str) -> None:
    """A never-firing expression looks 5 years ahead, not more, and is refused; the others around a
    gap are worked out (no timing asserted: the walk is bounded by construction, see next_after)."""
    try:
        got = Cron.parse(expr).next_after(utc(2024, 3, 10, 6, 30), tz)
    except CronError as exc:
        assert "never fires" in str(exc)
    else:
        assert got > utc(2024, 3, 10, 6, 30)


def test_question_mark_is_any_in_the_day_fields_only() -> None:
    """Quartz-style crons (Trigger.dev's examples) write "?" for the day field that does not restrict."""
    assert nxt("0 0 ? * MON", "2026-01-01T00:00:00+00:00") == "2026-01-05T00:00:00+00:00"  # Thu → Mon
    assert nxt("0 0 1 * ?", "2026-01-01T00:00:00+00:00") == "2026-02-01T00:00:00+00:00"
    assert nxt("0 0 ? * ?", "2026-01-01T00:00:00+00:00") == "2026-01-02T00:00:00+00:00"
    for expr in ("? * * * *", "0 ? * * *", "0 0 * ? *", "0 0 1,? * *", "0 0 * * ?/2", "? 0 0 * * *"):
        with pytest.raises(CronError, match=r"'\?'"):
            Cron.parse(expr)


@pytest.mark.parametrize("expr,message", [("0 , * * *", "empty"), ("1,,2 * * * *", "empty"), ("0 0 , * *", "empty"),
                                          ("1, * * * *", "empty"), (",5 * * * *", "empty"), ("/5 * * * *", "step"),
                                          ("0 0 * * mon,", "empty")])
def test_an_empty_list_item_or_a_bare_step_is_refused_not_read_as_any(expr: str, message: str) -> None:
    with pytest.raises(CronError, match=message):
        Cron.parse(expr)


@pytest.mark.parametrize("expr,same_as", [("/5 * * * *", "*/5 * * * *"), ("0 , * * *", "0 * * * *"),
                                          ("1,,2 * * * *", "* * * * *"), ("0 0 , * *", "0 0 1-31 * *"),
                                          ("0 0 , * mon", "0 0 1-31 * mon"), ("0 0 * * mon,", "0 0 * * 0-6"),
                                          ("0 /6 * * *", "0 */6 * * *"), ("0 0 ? * /2", "0 0 * * */2")])
def test_read_leniently_an_empty_item_is_any_and_a_bare_step_starts_at_the_lowest(expr: str, same_as: str) -> None:
    """As the versions before read them: the crons they accepted and stored keep firing as they did."""
    old, new = Cron.parse(expr, lenient=True), Cron.parse(same_as)
    assert old.read_leniently and not new.read_leniently
    fields = ("seconds", "minutes", "hours", "days", "months", "weekdays", "any_day", "any_weekday")
    assert [getattr(old, f) for f in fields] == [getattr(new, f) for f in fields]
    start = datetime(2026, 1, 1, tzinfo=UTC)
    for _ in range(50):
        assert old.next_after(start) == new.next_after(start)
        start = new.next_after(start)


def test_read_leniently_is_strict_otherwise() -> None:
    assert not Cron.parse("*/5 * * * *", lenient=True).read_leniently
    assert not Cron.parse("0 0 ? * MON", lenient=True).read_leniently
    for expr in ("? * * * *", "0 0 1,? * *", "5/ * * * *", "/ * * * *", "/0 * * * *", "60 * * * *"):
        with pytest.raises(CronError):
            Cron.parse(expr, lenient=True)


@pytest.mark.parametrize("expr", ["* * * *", "60 * * * *", "* 24 * * *", "*/0 * * * *", "a b c d e", "5-1 * * * *"])
def test_bad_expressions_are_refused(expr: str) -> None:
    with pytest.raises(CronError):
        Cron.parse(expr)


def test_unknown_timezone_is_refused() -> None:
    with pytest.raises(CronError, match="unknown timezone"):
        Cron.parse("* * * * *").next_after(datetime(2026, 1, 1, tzinfo=UTC), "Mars/Olympus")


def _answer(expr: str, after: datetime, tz: str) -> str:
    try:
        return Cron.parse(expr, lenient=True).next_after(after, tz).isoformat()
    except CronError as exc:
        return f"refused: {exc}"


def test_a_cron_no_day_can_match_is_refused_as_the_search_refuses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal without a search (``Cron.no_day_matches``: a day-of-month past the longest of
    its months, February's 29) answers every expression as the 5-year search alone does: the same
    tick or the same error, a bad timezone or date first; February 29th is left to the search,
    which finds it in a leap year or refuses it from March 2097 (2100 is not one)."""
    exprs = [f"0 0 {day} {month} {weekday}"
             for day in ("1", "28", "29", "30", "31", "29-31", "30,31", "31/5", ",31", "*", "?")
             for month in ("*", "2", "feb", "4", "4,6,9,11", "2,4", "2-4", "*/2", "2/12", "1")
             for weekday in ("*", "?", "1")] + ["@yearly", "0 0 0 30 2 *"]
    cases = [(e, after, tz) for e in exprs
             for after, tz in ((utc(2024, 3, 10, 6, 30), "America/New_York"), (utc(2097, 3, 1), "UTC"))]
    cases += [("0 0 30 2 *", utc(2026, 1, 1), "Mars/Olympus"), ("0 0 30 2 *", utc(9999, 12, 1), "UTC")]
    answers = [_answer(*case) for case in cases]
    assert sum(Cron.parse(e, lenient=True).no_day_matches() for e in exprs) > 30  # not a vacuous check
    monkeypatch.setattr(Cron, "no_day_matches", lambda self: False)  # the search alone
    assert answers == [_answer(*case) for case in cases]
    assert "refused: '0 0 29 2 *' never fires" in answers and "2028-02-29T05:00:00+00:00" in answers
