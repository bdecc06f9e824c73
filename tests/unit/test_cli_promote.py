"""`run-engine promote VERSION` calls POST /api/v1/deployments/{version}/promote (the version
URL-encoded whole: a slash, a space, unicode), prints one line per worker group or the answer as
JSON, and an error as one line and exit 1 (a message quoting odd input is printed as it is)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from .test_cli_errors import FakeApi, cli, serving

SEEN: list[tuple[str, Any]] = []


class _Api(FakeApi):
    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        SEEN.append((self.path, json.loads(raw) if raw else None))
        if "missing" in self.path:
            self.answer(404, {"error": {"code": "not_found",
                                        "message": "no deployment of version '[/]missing' in this environment"}})
            return
        d = {"id": "deployment_1", "version": "release/1 ü", "workerGroupId": "wg_1", "alreadyCurrent": False,
             "pendingRunsEnqueued": 3}
        self.answer(200, {**d, "deployments": [d]})


@pytest.fixture
def api() -> Iterator[str]:
    SEEN.clear()
    with serving(_Api) as url:
        yield url


def test_promote_names_the_version_whole_and_says_what_became_current(api: str) -> None:
    out = cli("promote", "release/1 ü", "--api-url", api, "--api-key", "tr_dev_x")
    assert out.returncode == 0, out
    assert SEEN == [("/api/v1/deployments/release%2F1%20%C3%BC/promote", {})]
    assert "version release/1 ü is current in worker group wg_1 (deployment_1); 3 waiting runs enqueued" in out.stdout
    out = cli("promote", "v2", "--worker-group", "gpu", "--json", "--api-url", api, "--api-key", "tr_dev_x")
    assert out.returncode == 0, out
    assert SEEN[-1] == ("/api/v1/deployments/v2/promote", {"workerGroup": "gpu"})
    assert json.loads(out.stdout)["deployments"][0]["id"] == "deployment_1"


def test_promote_of_an_unknown_version_is_one_line_and_exit_1(api: str) -> None:
    out = cli("promote", "[/]missing", "--api-url", api, "--api-key", "tr_dev_x")
    assert out.returncode == 1, out
    assert "Traceback" not in out.stderr and "MarkupError" not in out.stderr, out.stderr
    assert out.stderr.strip() == "404 not_found: no deployment of version '[/]missing' in this environment"
