"""Routing to worker groups: the trigger option `workerGroup` sends a run to a named group of the
project (unknown: 400), `worker-groups set-default` changes where runs go by default, and
`GET /api/v1/worker-groups` (and `worker-groups list`) shows the groups with their instances."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator

import pytest

from .conftest import Stack, stop


@pytest.fixture(scope="module")
def routed(stack: Stack) -> Iterator[Stack]:
    """A project whose default group has no supervisor, and a group `gpu` with one."""
    project = stack.project("routing")
    made = json.loads(project.cli("worker-groups", "create", "gpu", "--org", "e2e", "--project", "routing",
                                  "--json").stdout)
    gpu = dataclasses.replace(project, token=made["token"])
    proc = gpu.start_supervisor("routing-gpu")
    deadline = time.monotonic() + 60
    while True:
        with project.client() as c:
            groups = {g["name"]: g for g in c.get("/api/v1/worker-groups").json()["data"]}
        if groups.get("gpu", {}).get("instances"):
            break
        assert time.monotonic() < deadline, "the gpu supervisor did not connect"
        time.sleep(0.1)
    yield project
    stop(proc)


def test_a_run_goes_to_the_group_it_names(routed: Stack) -> None:
    stays = routed.trigger("echo", {"n": 0})  # the default group: nobody serves it
    sent = routed.trigger("echo", {"n": 1}, workerGroup="gpu")
    delayed = routed.trigger("echo", {"n": 2}, workerGroup="gpu", delay="1s")  # its group's deployment when due
    assert routed.wait_for(sent)["status"] == "COMPLETED"
    assert routed.run(stays)["status"] == "PENDING_VERSION"  # no deployment in its group
    assert routed.wait_for(delayed)["status"] == "COMPLETED"
    with routed.client() as c:
        bad = c.post("/api/v1/tasks/echo/trigger", json={"options": {"workerGroup": "no-such-group"}})
        assert bad.status_code == 400 and "options.workerGroup" in bad.json()["error"]["message"]
        bad = c.post("/api/v1/tasks/batch", json={"items": [
            {"task": "echo"}, {"task": "echo", "options": {"workerGroup": "nope"}}]})
        assert bad.status_code == 400 and "workerGroup" in bad.json()["error"]["message"]
        groups = c.get("/api/v1/worker-groups").json()["data"]
    by_name = {g["name"]: g for g in groups}
    assert by_name["gpu"]["isDefault"] is False and by_name["gpu"]["instances"][0]["lastHeartbeatAt"]
    assert [g["name"] for g in groups if g["isDefault"]] == ["main"]
    # a replay goes where its run went
    with routed.client() as c:
        replayed = c.post(f"/api/v1/runs/{sent}/replay").json()["id"]
    assert routed.wait_for(replayed)["status"] == "COMPLETED"


def test_another_project_cannot_name_this_projects_group(routed: Stack, stack: Stack) -> None:
    other = stack.project("routing-other")
    with other.client() as c:
        r = c.post("/api/v1/tasks/echo/trigger", json={"options": {"workerGroup": "gpu"}})
    assert r.status_code == 400 and "no worker group named 'gpu'" in r.json()["error"]["message"]


def test_set_default_sends_new_runs_to_the_group(routed: Stack) -> None:
    out = json.loads(routed.cli("worker-groups", "set-default", "gpu", "--org", "e2e", "--project", "routing",
                                "--json").stdout)
    assert out == {"name": "gpu", "environments": 1}
    listed = json.loads(routed.cli("worker-groups", "list", "--json", "--api-url", routed.url,
                                   "--api-key", routed.api_key).stdout)["data"]
    assert [g["name"] for g in listed if g["isDefault"]] == ["gpu"]
    # servers cache an environment for a couple of seconds: poll until a plain trigger lands in gpu
    deadline = time.monotonic() + 30
    while True:
        run_id = routed.trigger("echo", {"plain": True})
        if routed.run(run_id)["status"] != "PENDING_VERSION":
            break
        assert time.monotonic() < deadline, "plain triggers still go to the old default group"
        time.sleep(0.2)
    assert routed.wait_for(run_id)["status"] == "COMPLETED"
    bad = routed.cli("worker-groups", "set-default", "nope", "--org", "e2e", "--project", "routing", check=False)
    assert bad.returncode != 0 and "no worker group 'nope'" in bad.stderr
