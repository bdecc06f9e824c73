"""Organizations, projects, environments and worker groups: create what is missing, and their
credentials.

Secrets are derived, not stored: an environment's API key is HMAC(secret, env id, generation), a
worker group's token HMAC(secret, group id, generation), an environment-scoped worker group token
HMAC(secret, group id + env id, generation), and only their SHA-256 hashes are kept. So `bootstrap`
can print the same working key again without the database ever holding it, and rotating a key
(bumping its generation) makes the old one stop matching. The installation secret itself is never
stored in the database: see :func:`resolve_secret`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets as _secrets
from dataclasses import dataclass
from pathlib import Path

from run_engine.db.repository import Repository
from run_engine.errors import ConfigurationError, NotFoundError
from run_engine.ids import new_id

ENV_KEY_PREFIX = {"DEVELOPMENT": "tr_dev_", "STAGING": "tr_stg_", "PRODUCTION": "tr_prod_"}
ENV_TYPES = {"dev": "DEVELOPMENT", "development": "DEVELOPMENT", "staging": "STAGING", "stg": "STAGING",
             "prod": "PRODUCTION", "production": "PRODUCTION"}
SECRET_FILE = "secret"
MIN_SECRET_LENGTH = 16


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def _derive(secret: str, purpose: str, ident: str, generation: int = 0) -> str:
    message = f"{purpose}.{ident}" if generation == 0 else f"{purpose}.{ident}.g{generation}"
    digest = hmac.new(secret.encode(), message.encode(), hashlib.sha256).digest()
    return base64.b32encode(digest[:20]).decode().lower()


def api_key_for(secret: str, env_id: str, env_type: str, generation: int = 0) -> str:
    return ENV_KEY_PREFIX[env_type] + _derive(secret, "apikey", env_id, generation)


def worker_group_token_for(secret: str, group_id: str, generation: int = 0) -> str:
    return "tr_wgt_" + _derive(secret, "wgt", group_id, generation)


def env_worker_group_token_for(secret: str, group_id: str, env_id: str, generation: int = 0) -> str:
    """A worker group token that serves one environment of the group only."""
    return "tr_wgt_" + _derive(secret, "wgt-env", f"{group_id}.{env_id}", generation)


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
    env_worker_group_token: str = ""


async def ensure_environment(
    repo: Repository, *, secret: str, org: str, project: str, env: str = "dev", env_type: str | None = None,
    concurrency_limit: int = 100,
) -> Environment:
    env_type = env_type or env_type_of(env)
    ids = {"org": new_id("org"), "project": new_id("proj"), "env": new_id("env"), "worker_group": new_id("wg")}
    got = await repo.tenancy.ensure_environment(
        org_slug=org, project_slug=project, env_slug=env, env_type=env_type,
        api_key_hash=hash_secret(api_key_for(secret, ids["env"], env_type)),
        worker_group_token_hash=hash_secret(worker_group_token_for(secret, ids["worker_group"])),
        concurrency_limit=concurrency_limit, ids=ids,
    )
    api_key = api_key_for(secret, got.env_id, got.env_type, got.api_key_generation)
    token = worker_group_token_for(secret, got.worker_group_id, got.token_generation)
    # Keys of rows made under another secret are re-derived, so the printed ones always work.
    await repo.tenancy.rotate_api_key(got.env_id, hash_secret(api_key))
    await repo.tenancy.rotate_worker_group_token(got.worker_group_id, hash_secret(token))
    generation = await repo.tenancy.env_worker_token_generation(got.worker_group_id, got.env_id)
    env_token = env_worker_group_token_for(secret, got.worker_group_id, got.env_id, generation)
    await repo.tenancy.set_env_worker_token(got.worker_group_id, got.env_id, generation, hash_secret(env_token))
    return Environment(got.org_id, got.project_id, got.env_id, got.worker_group_id, api_key, token, env_token)


async def rotate_api_key(repo: Repository, *, secret: str, env_id: str) -> str:
    """A new API key for the environment; the old one is refused from now on (servers cache a
    validated key for at most 5 seconds)."""
    bumped = await repo.tenancy.bump_api_key_generation(env_id)
    if bumped is None:
        raise NotFoundError("environment", env_id)
    generation, env_type = bumped
    key = api_key_for(secret, env_id, env_type, generation)
    await repo.tenancy.rotate_api_key(env_id, hash_secret(key))
    return key


async def rotate_worker_group_token(repo: Repository, *, secret: str, group_id: str,
                                    env_id: str | None = None) -> str:
    """A new token for the worker group (or for its token scoped to ``env_id``)."""
    if env_id is None:
        generation = await repo.tenancy.bump_worker_group_token_generation(group_id)
        if generation is None:
            raise NotFoundError("worker group", group_id)
        token = worker_group_token_for(secret, group_id, generation)
        await repo.tenancy.rotate_worker_group_token(group_id, hash_secret(token))
        return token
    generation = await repo.tenancy.env_worker_token_generation(group_id, env_id) + 1
    token = env_worker_group_token_for(secret, group_id, env_id, generation)
    await repo.tenancy.set_env_worker_token(group_id, env_id, generation, hash_secret(token))
    return token


async def create_worker_group(repo: Repository, *, secret: str, name: str, project_id: str | None,
                              make_default: bool = False) -> tuple[str, str]:
    group_id = new_id("wg")
    token = worker_group_token_for(secret, group_id)
    await repo.tenancy.create_worker_group(group_id, name, project_id, hash_secret(token), make_default)
    return group_id, token


def resolve_secret(configured: str | None, data_dir: Path | None = None, *, generate: bool = False) -> str:
    """The installation secret: ``RUN_ENGINE_SECRET`` when set; else the ``secret`` file of the
    data folder (``run-engine dev`` writes one, mode 0600, when ``generate``); else a
    :class:`ConfigurationError` that says what to do. It is never stored in the database."""
    if configured:
        if len(configured) < MIN_SECRET_LENGTH:
            raise ConfigurationError(f"RUN_ENGINE_SECRET is shorter than {MIN_SECRET_LENGTH} characters; "
                                     "use a long random string")
        return configured
    path = (data_dir or Path(".run-engine")) / SECRET_FILE
    if path.exists():
        value = path.read_text().strip()
        if len(value) >= MIN_SECRET_LENGTH:
            return value
    if not generate:
        raise ConfigurationError(
            "RUN_ENGINE_SECRET is not set. Set it to a long random string, the same for every server, "
            "e.g. `export RUN_ENGINE_SECRET=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')`; "
            "every API key and worker token is derived from it. (`run-engine dev` generates one into "
            f"{path} for local use.)")
    path.parent.mkdir(parents=True, exist_ok=True)
    value = _secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process wrote it first: use theirs
        return resolve_secret(None, data_dir)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value
