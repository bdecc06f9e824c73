"""Organizations, projects, environments and worker groups: create what is missing.

Secrets (environment API keys, worker group tokens) are shown once and stored as SHA-256 hashes.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from run_engine.db.repository import Repository
from run_engine.ids import new_id

ENV_KEY_PREFIX = {"DEVELOPMENT": "tr_dev_", "STAGING": "tr_stg_", "PRODUCTION": "tr_prod_"}


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Environment:
    org_id: str
    project_id: str
    env_id: str
    worker_group_id: str
    api_key: str | None  # None when the environment already existed (its key is not recoverable)
    worker_group_token: str | None


async def ensure_environment(
    repo: Repository, *, org: str, project: str, env: str = "dev", env_type: str = "DEVELOPMENT",
    concurrency_limit: int = 100,
) -> Environment:
    api_key = ENV_KEY_PREFIX[env_type] + secrets.token_urlsafe(24)
    wg_token = "tr_wgt_" + secrets.token_urlsafe(24)
    ids = {"org": new_id("org"), "project": new_id("proj"), "env": new_id("env"), "worker_group": new_id("wg")}
    got = await repo.ensure_environment(
        org_slug=org, project_slug=project, env_slug=env, env_type=env_type,
        api_key_hash=hash_secret(api_key), worker_group_token_hash=hash_secret(wg_token),
        concurrency_limit=concurrency_limit, ids=ids,
    )
    return Environment(
        org_id=got["org"], project_id=got["project"], env_id=got["env"], worker_group_id=got["worker_group"],
        api_key=api_key if got["env"] == ids["env"] else None,
        worker_group_token=wg_token if got["worker_group"] == ids["worker_group"] else None,
    )
