"""The keys the SDK gives a run's triggers and batches inside it (``sdk:<run>:<attempt>:…``) are
the same on every replay of the attempt, and whoever reads the run sees them: a public access
token that may trigger the task must not take the key of a run's next trigger (that run's child
would be the token holder's run, with its payload) nor of its next batch. They are refused to
public tokens as the engine's own keys are (403); other keys, and the secret key, are not."""

from __future__ import annotations

from .conftest import Harness


async def test_a_public_token_cannot_take_the_key_of_a_runs_next_trigger_or_batch(h: Harness) -> None:
    from run_engine.api.public_tokens import AUDIENCE, ISSUER, sign
    from run_engine.ids import new_id

    from .conftest import api_client

    now = int(h.clock.now())
    token = sign(h.env.api_key, {"sub": h.env.env_id, "pub": True, "iss": ISSUER, "aud": AUDIENCE, "iat": now,
                                 "exp": now + 600, "scopes": ["trigger:tasks:hello", "batchTrigger:tasks:hello"]})
    parent = new_id("run")
    async with api_client(h, token) as browser:
        taken = await browser.post("/api/v1/tasks/hello/trigger", json={
            "payload": {"forged": True}, "options": {"idempotencyKey": f"sdk:{parent}:1:hello:0"}})
        assert taken.status_code == 403, taken.text  # before: 200, the run's next child taken
        assert taken.json()["error"]["code"] == "forbidden"
        item = await browser.post("/api/v1/tasks/batch", json={
            "items": [{"task": "hello", "options": {"idempotencyKey": f"sdk:{parent}:1:s3:hello:0"}}]})
        assert item.status_code == 403, item.text
        for path in ("/api/v1/tasks/batch", "/api/v2/tasks/batch"):
            batch = await browser.post(path, json={"items": [{"task": "hello"}]},
                                       headers={"idempotency-key": f"sdk:{parent}:1:batch:hello:0"})
            assert batch.status_code == 403, batch.text  # before: 200, the run's next batch taken
        mine = await browser.post("/api/v1/tasks/hello/trigger", json={"options": {"idempotencyKey": "sdk:mine"}})
        assert mine.status_code == 200, mine.text  # a key of any other shape
        batched = await browser.post("/api/v1/tasks/batch", json={"items": [{"task": "hello"}]},
                                     headers={"idempotency-key": f"sdk:{new_id('batch')}"})
        assert batched.status_code == 200, batched.text
    async with api_client(h) as secret:  # the environment's secret key names any key
        named = await secret.post("/api/v1/tasks/hello/trigger",
                                  json={"options": {"idempotencyKey": f"sdk:{parent}:1:hello:0"}})
        assert named.status_code == 200, named.text
