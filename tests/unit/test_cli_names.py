"""The CLI's client commands send a name or id as one path segment, percent-encoded whole (a queue
named `a?b#c`, a slash, a space, a `%`), and print names as they are (a queue named `[/]` or
`[prod]` is not read as rich markup: before, the first was a traceback, the second vanished)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .test_cli_errors import FakeApi, cli, serving

SEEN: list[str] = []
NAMES = ["[/]", "[prod] emails", "task/hello"]


class _Api(FakeApi):
    def do_GET(self) -> None:
        SEEN.append(self.path)
        self.answer(200, {"data": [{"name": n, "type": "custom", "running": 0, "queued": 1, "concurrencyLimit": None,
                                    "paused": False} for n in NAMES]})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        SEEN.append(self.path)
        self.answer(200, {"name": "whatever", "paused": True, "id": "run_1"})


@pytest.fixture
def api() -> Iterator[str]:
    SEEN.clear()
    with serving(_Api) as url:
        yield url


def test_a_name_is_one_path_segment_whatever_it_holds(api: str) -> None:
    out = cli("queues", "pause", "a?b#c %d/e", "--api-url", api, "--api-key", "tr_dev_x")
    assert out.returncode == 0, out
    assert SEEN == ["/api/v1/queues/a%3Fb%23c%20%25d%2Fe/pause"]
    assert out.stdout.strip() == "a?b#c %d/e: paused"
    out = cli("runs", "cancel", "run_1?x=1", "--api-url", api, "--api-key", "tr_dev_x")
    assert out.returncode == 0, out
    assert SEEN[-1] == "/api/v2/runs/run_1%3Fx%3D1/cancel"


def test_names_are_printed_as_they_are(api: str) -> None:
    out = cli("queues", "list", "--api-url", api, "--api-key", "tr_dev_x")
    assert out.returncode == 0, out
    assert "Traceback" not in out.stderr, out.stderr
    for name in NAMES:
        assert name in out.stdout, out.stdout
    out = cli("queues", "pause", "[bold]x[/bold]", "--api-url", api, "--api-key", "tr_dev_x")
    assert out.returncode == 0, out
    assert out.stdout.strip() == "[bold]x[/bold]: paused"
