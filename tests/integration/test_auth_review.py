"""An attacker's review of tenant isolation over HTTP: two environments of one project share its
worker group (``main``), each with a worker token scoped to it, and a third environment is of
another organization. Every credential of one environment, given an id of another (a run, a
snapshot, a waitpoint token, a batch, a signed URL), is answered as if the id did not exist, and
nothing of the other environment is shown: its supervisors neither."""

from __future__ import annotations

import base64
import time
from typing import Any

import httpx
import orjson

from run_engine.api.models import TaskDecl
from run_engine.api.public_tokens import AUDIENCE, ISSUER, sign
from run_engine.tenancy import Environment, ensure_environment

from .conftest import Harness, api_client

W = "/engine/v1/worker-actions"


async def environment(h: Harness, org: str, project: str = "proj", env: str = "prod") -> Environment:
    """Another environment with the task ``hello`` deployed: of the harness's project when ``org``
    is the harness's (``org-<unique>``) and ``project`` is ``proj``."""
    made = await ensure_environment(h.engine.resources.repo, secret="test-secret", org=org, project=project, env=env)
    await h.engine.register_deployment(env_id=made.env_id, worker_group_id=made.worker_group_id, version="1",
                                       content_hash="hash-1", tasks=[TaskDecl.model_validate({"id": "hello"}).spec()],
                                       queues=[])
    return made


def public_token(h: Harness, env: Environment, scopes: list[str], sub: str | None = None,
                 **claims: Any) -> str:
    now = int(h.clock.now())
    return sign(env.api_key, {"sub": sub or env.env_id, "pub": True, "iss": ISSUER, "aud": AUDIENCE, "iat": now,
                              "exp": now + 600, "scopes": scopes, **claims})


def unsigned_token(h: Harness, env: Environment) -> str:
    """A JWT of ``alg: none`` with every scope: never accepted."""
    def part(value: Any) -> str:
        return base64.urlsafe_b64encode(orjson.dumps(value)).decode().rstrip("=")
    claims = {"sub": env.env_id, "pub": True, "iss": ISSUER, "aud": AUDIENCE, "exp": int(h.clock.now()) + 600,
              "scopes": ["admin"]}
    return f"{part({'alg': 'none', 'typ': 'JWT'})}.{part(claims)}."


async def started(h: Harness, env: Environment, tags: tuple[str, ...] = ()) -> dict[str, Any]:
    """A run of ``hello`` in ``env``, triggered with its key and started by its scoped worker token:
    the dequeue's item (``run``, ``attempt`` with its ``snapshot`` and ``runToken``)."""
    async with api_client(h, env.api_key) as api:
        got = await api.post("/api/v1/tasks/hello/trigger", json={"payload": 1, "options": {"tags": list(tags)}})
        assert got.status_code == 200, got.text
        run_id = got.json()["id"]
    async with api_client(h, env.env_worker_group_token) as worker:
        deadline = time.monotonic() + 10
        while True:
            answer = await worker.post(f"{W}/dequeue", json={"maxRuns": 10, "startAttempts": True})
            assert answer.status_code == 200, answer.text
            for item in answer.json()["runs"]:
                if item["run"]["id"] == run_id:
                    return dict(item)
            assert time.monotonic() < deadline, "the run was never handed out"


def not_found(answer: httpx.Response) -> bool:
    return answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"


async def test_an_environment_is_not_shown_the_supervisors_of_another_environment_of_its_group(
        h: Harness, unique: str) -> None:
    """A token scoped to one environment names its supervisors ``<environment id>/<name>`` in the
    group the project's environments share. Another environment's key listed them (GET
    /api/v1/worker-groups, the dashboard's workers page): that environment's id, its hosts'
    names and their concurrency."""
    prod = await environment(h, f"org-{unique}")
    async with api_client(h, prod.env_worker_group_token) as worker:
        connected = await worker.post(f"{W}/connect", json={
            "workerInstanceName": "prod-box-1", "concurrency": 7, "deployment": {"tasks": [{"id": "hello"}]}})
        assert connected.status_code == 200, connected.text
    async with api_client(h, h.env.env_worker_group_token) as worker:
        beat = await worker.post(f"{W}/heartbeat", json={"workerInstanceName": "dev-box"})
        assert beat.status_code == 200, beat.text
    async with api_client(h, h.env.worker_group_token) as worker:  # the project's own token: every environment's
        beat = await worker.post(f"{W}/heartbeat", json={"workerInstanceName": "shared-box"})
        assert beat.status_code == 200, beat.text

    async def listed(env: Environment) -> set[str]:
        async with api_client(h, env.api_key) as api:
            answer = await api.get("/api/v1/worker-groups")
        assert answer.status_code == 200, answer.text
        (group,) = answer.json()["data"]
        return {i["name"] for i in group["instances"]}

    assert await listed(h.env) == {f"{h.env.env_id}/dev-box", "shared-box"}
    assert await listed(prod) == {f"{prod.env_id}/prod-box-1", "shared-box"}
    (view,) = await h.engine.workers(h.env.env_id)  # the dashboard's workers page
    assert {i["name"] for i in view.instances} == {f"{h.env.env_id}/dev-box", "shared-box"}
