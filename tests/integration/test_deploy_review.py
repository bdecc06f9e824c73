"""From a review of deployments, connect, worker groups and versions."""

from __future__ import annotations

import pytest

from .conftest import Harness, api_client

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)

CONNECT = "/engine/v1/worker-actions/connect"


async def test_a_connect_answers_the_version_of_the_deployment_it_registered(h: Harness) -> None:
    """The same tasks connected again under another version are the deployment registered before
    (content-hashed): the answer names that deployment's version, not the one asked for, which no
    deployment has (a trigger locking to it would be refused)."""
    body = {"workerInstanceName": "w", "deployment": {"version": "first", "tasks": [{"id": "x"}]}}
    async with api_client(h, h.env.worker_group_token) as worker:
        first = await worker.post(CONNECT, json=body)
        assert first.status_code == 200 and first.json()["version"] == "first", first.text
        body["deployment"]["version"] = "second"  # type: ignore[index]
        again = await worker.post(CONNECT, json=body)
        assert again.status_code == 200, again.text
        assert again.json()["deploymentId"] == first.json()["deploymentId"]
        assert again.json()["version"] == "first"
