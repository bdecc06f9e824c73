-- 0005_credentials (issue 10): credentials that can be rotated and narrowed, and no secret in the
-- database.
-- A key is derived from the installation secret and a generation; rotating bumps the generation,
-- so the old key no longer matches the stored hash.
ALTER TABLE runtime_environment ADD COLUMN api_key_generation integer NOT NULL DEFAULT 0;
ALTER TABLE worker_group ADD COLUMN token_generation integer NOT NULL DEFAULT 0;

-- A worker group token narrowed to one environment: a supervisor holding it connects and dequeues
-- for that environment only.
CREATE TABLE worker_group_env_token (
    worker_group_id  text NOT NULL REFERENCES worker_group(id) ON DELETE CASCADE,
    environment_id   text NOT NULL REFERENCES runtime_environment(id) ON DELETE CASCADE,
    token_hash       text NOT NULL UNIQUE,
    generation       integer NOT NULL DEFAULT 0,
    created_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (worker_group_id, environment_id)
);

-- The installation secret was generated into this table when RUN_ENGINE_SECRET was unset: one
-- database read then gave every key. It now lives only in RUN_ENGINE_SECRET (or, for `run-engine
-- dev`, a 0600 file in its data folder); keys derived from a removed secret are re-derived by
-- `run-engine bootstrap`.
DELETE FROM engine_setting WHERE key = 'run_engine_secret';
