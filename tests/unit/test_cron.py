"""Cron expressions: fields, names, steps, macros, timezones and DST."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from run_engine.cron import Cron, CronError


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
    # 02:30 does not exist in Paris on 2026-03-29: that day is skipped
    assert nxt("30 2 * * *", "2026-03-28T02:00:00+00:00", "Europe/Paris") == "2026-03-30T00:30:00+00:00"
    # 02:30 happens twice on 2026-10-25: it fires once
    first = Cron.parse("30 2 * * *").next_after(datetime(2026, 10, 24, 12, tzinfo=UTC), "Europe/Paris")
    second = Cron.parse("30 2 * * *").next_after(first, "Europe/Paris")
    assert first.isoformat() == "2026-10-25T00:30:00+00:00" and second.date().isoformat() == "2026-10-26"


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


@pytest.mark.parametrize("expr", ["* * * *", "60 * * * *", "* 24 * * *", "*/0 * * * *", "a b c d e", "5-1 * * * *"])
def test_bad_expressions_are_refused(expr: str) -> None:
    with pytest.raises(CronError):
        Cron.parse(expr)


def test_unknown_timezone_is_refused() -> None:
    with pytest.raises(CronError, match="unknown timezone"):
        Cron.parse("* * * * *").next_after(datetime(2026, 1, 1, tzinfo=UTC), "Mars/Olympus")
