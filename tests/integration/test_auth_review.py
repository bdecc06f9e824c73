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


async def test_no_credential_of_an_environment_reaches_another_environments_ids(h: Harness, unique: str) -> None:
    prod = await environment(h, f"org-{unique}")  # the same project and worker group
    elsewhere = await environment(h, f"org2-{unique}", project="proj2", env="dev")  # another organization
    dev_item = await started(h, h.env, tags=("shared",))
    prod_item = await started(h, prod, tags=("shared",))
    dev_run, dev_snapshot = dev_item["run"]["id"], dev_item["attempt"]["snapshot"]["id"]
    prod_run, prod_snapshot = prod_item["run"]["id"], prod_item["attempt"]["snapshot"]["id"]
    async with api_client(h, prod.api_key) as api:
        prod_token = (await api.post("/api/v1/waitpoints/tokens", json={})).json()
        prod_batch = (await api.post("/api/v1/tasks/batch", json={"items": [
            {"task": "hello", "payload": 1, "options": {"delay": "1h", "tags": ["shared"]}}]})).json()["id"]

    # the worker API: dev's scoped token on prod's run, and dev's run waiting on prod's ids
    async with api_client(h, h.env.env_worker_group_token) as worker:
        assert not_found(await worker.get(f"{W}/runs/{prod_run}/snapshots/latest"))
        assert not_found(await worker.post(f"{W}/runs/{prod_run}/snapshots/{prod_snapshot}/heartbeat"))
        assert not_found(await worker.get(f"{W}/runs/{prod_run}/journal"))
        started_again = await worker.post(f"{W}/attempts/start", json={"items": [
            {"runId": prod_run, "snapshotId": prod_snapshot}]})
        assert [r["status"] for r in started_again.json()["results"]] == [404]
        waits = await worker.post(f"{W}/waits", json={"items": [
            {"runId": dev_run, "snapshotId": dev_snapshot, "waitpointId": prod_token["id"], "sequence": 0}]})
        assert [r["status"] for r in waits.json()["results"]] == [404], waits.text
        for waited, kind in ((prod_token["id"], "token"), (prod_run, "token"), (prod_token["id"], "child")):
            assert not_found(await worker.post(f"{W}/runs/{dev_run}/snapshots/{dev_snapshot}/waitpoints/{waited}/wait",
                                               json={"sequence": 0, "kind": kind}))
        narrowed = await worker.post(f"{W}/dequeue", json={"maxRuns": 1, "environments": [prod.env_id]})
        assert narrowed.status_code == 403
    async with api_client(h, elsewhere.worker_group_token) as worker:
        assert not_found(await worker.get(f"{W}/runs/{dev_run}/snapshots/latest"))

    # public access tokens
    for token, expected in ((public_token(h, h.env, ["admin"], sub=prod.env_id), 401),  # dev's key, prod's sub
                            (unsigned_token(h, h.env), 401),
                            (public_token(h, h.env, ["admin"], exp=None), 401),
                            (public_token(h, h.env, [f"read:runs:{dev_run[:-1]}"]), 403)):  # a prefix of the id
        async with api_client(h, token) as public:
            assert (await public.get(f"/api/v3/runs/{dev_run}")).status_code == expected
    async with api_client(h, public_token(h, h.env, ["admin"])) as public:
        assert not_found(await public.get(f"/api/v3/runs/{prod_run}"))
    async with api_client(h, public_token(h, h.env, ["read:tags:shared", f"read:batch:{prod_batch}"])) as public:
        shape = await public.get("/realtime/v1/runs?tags=shared&offset=-1")
        assert shape.status_code == 200, shape.text
        assert [m["value"]["id"] for m in shape.json() if "value" in m] == [dev_run]
        assert not_found(await public.get(f"/realtime/v1/batches/{prod_batch}?offset=-1"))
        assert not_found(await public.get(f"/api/v1/batches/{prod_batch}"))
        url = (await public.get(f"/api/v1/runs/{dev_run}/packets/payload")).json()["presignedUrl"]

    # signed URLs: a packet URL names its environment, run and field; a callback signature its token
    own = url.removeprefix("http://t")
    async with api_client(h) as api:
        assert (await api.get(own)).status_code == 200
        assert (await api.get(own.replace(dev_run, prod_run))).status_code == 403
        assert (await api.get(own.replace(h.env.env_id, prod.env_id).replace(dev_run, prod_run))).status_code == 403
        dev_token = (await api.post("/api/v1/waitpoints/tokens", json={})).json()
        signature = dev_token["url"].rsplit("/", 1)[1]
        replayed = await api.post(f"/api/v1/waitpoints/tokens/{prod_token['id']}/callback/{signature}", json={"x": 1})
        assert replayed.status_code == 401

    # dev's run token
    async with api_client(h, dev_item["attempt"]["runToken"]) as run_token:
        assert not_found(await run_token.get(f"/api/v3/runs/{prod_run}"))
        assert not_found(await run_token.put(f"/api/v1/runs/{prod_run}/metadata", json={"metadata": {"x": 1}}))
        assert not_found(await run_token.get(f"/api/v1/waitpoints/tokens/{prod_token['id']}"))
        assert not_found(await run_token.post(f"/api/v1/waitpoints/tokens/{prod_token['id']}/complete", json={}))
        assert not_found(await run_token.get(f"/api/v1/batches/{prod_batch}"))
        child = await run_token.post("/api/v1/tasks/hello/trigger", json={"payload": 1,
                                                                          "options": {"parentRunId": prod_run}})
        assert child.status_code == 403

    # dev's secret key
    async with api_client(h) as api:
        parented = await api.post("/api/v1/tasks/hello/trigger", json={"payload": 1, "options": {
            "parentRunId": prod_run, "resumeParentOnCompletion": True}})
        assert parented.status_code == 400, parented.text
        bulk = await api.post("/api/v1/bulk-actions", json={"action": "cancel", "runIds": [prod_run]})
        assert bulk.status_code == 200, bulk.text
        assert (await api.get(f"/api/v1/runs?filter[batch]={prod_batch}")).json()["data"] == []
    deadline = time.monotonic() + 10
    while (await h.engine.bulk_action(h.env.env_id, bulk.json()["id"])).status != "COMPLETED":  # type: ignore[union-attr]
        await h.engine.run_due_jobs()
        assert time.monotonic() < deadline
    async with api_client(h, prod.api_key) as api:
        assert (await api.get(f"/api/v3/runs/{prod_run}")).json()["status"] == "EXECUTING"
        assert (await api.get(f"/api/v1/waitpoints/tokens/{prod_token['id']}")).json()["status"] == "WAITING"
