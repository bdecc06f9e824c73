"""Organizations, projects, environments and worker groups: create what is missing.

Secrets are derived, not stored: an environment's API key is HMAC(secret, env id) and a worker
group's token HMAC(secret, group id), and only their SHA-256 hashes are kept. So `bootstrap` can
print the same working key again without the database ever holding it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass

from run_engine.db.repository import Repository
from run_engine.ids import new_id

ENV_KEY_PREFIX = {"DEVELOPMENT": "tr_dev_", "STAGING": "tr_stg_", "PRODUCTION": "tr_prod_"}
ENV_TYPES = {"dev": "DEVELOPMENT", "development": "DEVELOPMENT", "staging": "STAGING", "stg": "STAGING",
             "prod": "PRODUCTION", "production": "PRODUCTION"}


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _derive(secret: str, purpose: str, ident: str) -> str:
    digest = hmac.new(secret.encode(), f"{purpose}.{ident}".encode(), hashlib.sha256).digest()
    return base64.b32encode(digest[:20]).decode().lower()


def api_key_for(secret: str, env_id: str, env_type: str) -> str:
    return ENV_KEY_PREFIX[env_type] + _derive(secret, "apikey", env_id)


def worker_group_token_for(secret: str, group_id: str) -> str:
    return "tr_wgt_" + _derive(secret, "wgt", group_id)


def env_type_of(slug: str) -> str:
    return ENV_TYPES.get(slug.lower(), "DEVELOPMENT")


@dataclass(frozen=True, slots=True)
class Environment:
    org_id: str
    project_id: str
    env_id: str
    worker_group_id: str
    api_key: str
    worker_group_token: str


async def ensure_environment(
    repo: Repository, *, secret: str, org: str, project: str, env: str = "dev", env_type: str | None = None,
    concurrency_limit: int = 100,
) -> Environment:
    env_type = env_type or env_type_of(env)
    ids = {"org": new_id("org"), "project": new_id("proj"), "env": new_id("env"), "worker_group": new_id("wg")}
    got = await repo.ensure_environment(
        org_slug=org, project_slug=project, env_slug=env, env_type=env_type,
        api_key_hash=hash_secret(api_key_for(secret, ids["env"], env_type)),
        worker_group_token_hash=hash_secret(worker_group_token_for(secret, ids["worker_group"])),
        concurrency_limit=concurrency_limit, ids=ids,
    )
    api_key = api_key_for(secret, got["env"], env_type)
    token = worker_group_token_for(secret, got["worker_group"])
    # Keys of rows made under another secret are re-derived, so the printed ones always work.
    await repo.rotate_api_key(got["env"], hash_secret(api_key))
    await repo.rotate_worker_group_token(got["worker_group"], hash_secret(token))
    return Environment(got["org"], got["project"], got["env"], got["worker_group"], api_key, token)


async def create_worker_group(repo: Repository, *, secret: str, name: str, project_id: str | None,
                              make_default: bool = False) -> tuple[str, str]:
    group_id = new_id("wg")
    token = worker_group_token_for(secret, group_id)
    await repo.create_worker_group(group_id, name, project_id, hash_secret(token), make_default)
    return group_id, token


async def installation_secret(repo: Repository, configured: str | None) -> str:
    """``RUN_ENGINE_SECRET`` when set, else the secret generated and stored on first start."""
    if configured:
        return configured
    import secrets

    return await repo.ensure_setting("run_engine_secret", secrets.token_urlsafe(32))
