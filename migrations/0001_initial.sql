-- 0001_initial: the whole data model of DESIGN.md §4.
-- Ids are friendly prefixed text (run_…, snapshot_…); timestamps are timestamptz.

CREATE TABLE organization (
    id          text PRIMARY KEY,
    slug        text NOT NULL UNIQUE,
    title       text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE project (
    id               text PRIMARY KEY,
    organization_id  text NOT NULL REFERENCES organization(id) ON DELETE CASCADE,
    slug             text NOT NULL,
    title            text NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    UNIQUE (organization_id, slug)
);

CREATE TABLE worker_group (
    id                text PRIMARY KEY,
    name              text NOT NULL,
    project_id        text REFERENCES project(id) ON DELETE CASCADE,  -- NULL: the shared group
    token_hash        text NOT NULL UNIQUE,
    master_queue      text NOT NULL,
    created_at        timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX worker_group_name_uq ON worker_group (coalesce(project_id, ''), name);

CREATE TABLE runtime_environment (
    id                   text PRIMARY KEY,
    project_id           text NOT NULL REFERENCES project(id) ON DELETE CASCADE,
    type                 text NOT NULL CHECK (type IN ('DEVELOPMENT', 'STAGING', 'PRODUCTION')),
    slug                 text NOT NULL,
    api_key_hash         text NOT NULL UNIQUE,
    api_key_hint         text NOT NULL DEFAULT '',
    concurrency_limit    integer NOT NULL DEFAULT 100 CHECK (concurrency_limit >= 0),
    max_queue_length     integer,
    default_worker_group_id text REFERENCES worker_group(id),
    created_at           timestamptz NOT NULL DEFAULT now(),
    UNIQUE (project_id, slug)
);

CREATE TABLE worker_instance (
    id               text PRIMARY KEY,
    worker_group_id  text NOT NULL REFERENCES worker_group(id) ON DELETE CASCADE,
    name             text NOT NULL,
    last_heartbeat_at timestamptz NOT NULL DEFAULT now(),
    created_at       timestamptz NOT NULL DEFAULT now(),
    UNIQUE (worker_group_id, name)
);

CREATE TABLE deployment (
    id               text PRIMARY KEY,
    environment_id   text NOT NULL REFERENCES runtime_environment(id) ON DELETE CASCADE,
    worker_group_id  text NOT NULL REFERENCES worker_group(id) ON DELETE CASCADE,
    version          text NOT NULL,
    content_hash     text NOT NULL,
    tasks            jsonb NOT NULL DEFAULT '[]',
    queues           jsonb NOT NULL DEFAULT '[]',
    is_current       boolean NOT NULL DEFAULT false,
    created_at       timestamptz NOT NULL DEFAULT now(),
    UNIQUE (environment_id, worker_group_id, version)
);
CREATE UNIQUE INDEX deployment_current_uq ON deployment (environment_id, worker_group_id) WHERE is_current;

-- Tasks known to a deployment, with their retry policy; one row per (deployment, task).
CREATE TABLE deployment_task (
    deployment_id    text NOT NULL REFERENCES deployment(id) ON DELETE CASCADE,
    environment_id   text NOT NULL,
    task_identifier  text NOT NULL,
    queue_name       text NOT NULL,
    retry            jsonb,
    max_duration_s   integer,
    machine          text,
    PRIMARY KEY (deployment_id, task_identifier)
);
CREATE INDEX deployment_task_env_task ON deployment_task (environment_id, task_identifier);

CREATE TABLE task_queue (
    id                 text PRIMARY KEY,
    environment_id     text NOT NULL REFERENCES runtime_environment(id) ON DELETE CASCADE,
    name               text NOT NULL,
    type               text NOT NULL DEFAULT 'task' CHECK (type IN ('task', 'custom')),
    concurrency_limit  integer CHECK (concurrency_limit >= 0),
    concurrency_limit_override integer CHECK (concurrency_limit_override >= 0),
    concurrency_key_limit integer CHECK (concurrency_key_limit >= 0),
    rate_limit         jsonb,
    paused             boolean NOT NULL DEFAULT false,
    release_concurrency_on_waitpoint boolean NOT NULL DEFAULT true,
    created_at         timestamptz NOT NULL DEFAULT now(),
    UNIQUE (environment_id, name)
);

CREATE TABLE task_run (
    id                    text PRIMARY KEY,
    environment_id        text NOT NULL REFERENCES runtime_environment(id) ON DELETE CASCADE,
    worker_group_id       text NOT NULL,
    task_identifier       text NOT NULL,
    payload               jsonb,
    payload_type          text NOT NULL DEFAULT 'application/json',
    status                text NOT NULL,
    queue                 text NOT NULL,
    concurrency_key       text,
    priority_ms           integer NOT NULL DEFAULT 0,
    idempotency_key       text,
    idempotency_key_expires_at timestamptz,
    ttl_s                 integer,
    delay_until           timestamptz,
    tags                  text[] NOT NULL DEFAULT '{}',
    metadata              jsonb,
    max_attempts          integer,
    retry                 jsonb,
    max_duration_s        integer,
    machine               text,
    attempt_number        integer NOT NULL DEFAULT 0,
    output                jsonb,
    output_type           text,
    error                 jsonb,
    locked_to_deployment_id text,
    lock_to_version       text,
    parent_run_id         text,
    root_run_id           text,
    depth                 integer NOT NULL DEFAULT 0,
    batch_id              text,
    resume_parent_on_completion boolean NOT NULL DEFAULT false,
    trigger_function      text NOT NULL DEFAULT 'trigger',
    is_test               boolean NOT NULL DEFAULT false,
    created_at            timestamptz NOT NULL DEFAULT now(),
    updated_at            timestamptz NOT NULL DEFAULT now(),
    queued_at             timestamptz,
    queue_timestamp       timestamptz,
    started_at            timestamptz,
    finished_at           timestamptz,
    expired_at            timestamptz
);
CREATE INDEX task_run_env_created ON task_run (environment_id, created_at DESC, id DESC);
CREATE INDEX task_run_env_status ON task_run (environment_id, status);
CREATE INDEX task_run_parent ON task_run (parent_run_id) WHERE parent_run_id IS NOT NULL;
CREATE INDEX task_run_batch ON task_run (batch_id) WHERE batch_id IS NOT NULL;
CREATE INDEX task_run_pending_version ON task_run (environment_id, task_identifier) WHERE status = 'PENDING_VERSION';
CREATE INDEX task_run_finished ON task_run (finished_at) WHERE finished_at IS NOT NULL;
CREATE UNIQUE INDEX task_run_idempotency_uq ON task_run (environment_id, task_identifier, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

CREATE TABLE task_run_execution_snapshot (
    id                   text PRIMARY KEY,
    run_id               text NOT NULL REFERENCES task_run(id) ON DELETE CASCADE,
    seq                  bigint GENERATED ALWAYS AS IDENTITY,
    engine_status        text NOT NULL,
    run_status           text NOT NULL,
    attempt_number       integer NOT NULL DEFAULT 0,
    description          text NOT NULL DEFAULT '',
    previous_snapshot_id text,
    checkpoint_id        text,
    worker_id            text,
    completed_waitpoint_ids text[] NOT NULL DEFAULT '{}',
    is_valid             boolean NOT NULL DEFAULT true,
    error                jsonb,
    created_at           timestamptz NOT NULL DEFAULT now()
);
-- "latest valid snapshot of a run" is an index-only walk backwards on this index
CREATE INDEX snapshot_run_latest ON task_run_execution_snapshot (run_id, seq DESC) WHERE is_valid;
CREATE INDEX snapshot_created ON task_run_execution_snapshot (created_at);

CREATE TABLE waitpoint (
    id                  text PRIMARY KEY,
    environment_id      text NOT NULL REFERENCES runtime_environment(id) ON DELETE CASCADE,
    type                text NOT NULL CHECK (type IN ('RUN', 'DATETIME', 'MANUAL', 'BATCH')),
    status              text NOT NULL DEFAULT 'PENDING' CHECK (status IN ('PENDING', 'COMPLETED')),
    completed_by_run_id text,
    completed_by_batch_id text,
    completed_after     timestamptz,
    completed_at        timestamptz,
    idempotency_key     text,
    idempotency_key_expires_at timestamptz,
    user_provided_idempotency_key boolean NOT NULL DEFAULT false,
    output              jsonb,
    output_type         text NOT NULL DEFAULT 'application/json',
    output_is_error     boolean NOT NULL DEFAULT false,
    timeout_at          timestamptz,
    tags                text[] NOT NULL DEFAULT '{}',
    callback_secret     text,
    created_at          timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX waitpoint_idempotency_uq ON waitpoint (environment_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX waitpoint_completed_by_run ON waitpoint (completed_by_run_id) WHERE completed_by_run_id IS NOT NULL;
CREATE INDEX waitpoint_env_created ON waitpoint (environment_id, created_at DESC, id DESC);

CREATE TABLE task_run_waitpoint (
    run_id          text NOT NULL REFERENCES task_run(id) ON DELETE CASCADE,
    waitpoint_id    text NOT NULL REFERENCES waitpoint(id) ON DELETE CASCADE,
    batch_index     integer,
    span_id         text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, waitpoint_id)
);
CREATE INDEX task_run_waitpoint_waitpoint ON task_run_waitpoint (waitpoint_id);

CREATE TABLE batch_task_run (
    id                text PRIMARY KEY,
    environment_id    text NOT NULL REFERENCES runtime_environment(id) ON DELETE CASCADE,
    size              integer NOT NULL,
    completed_count   integer NOT NULL DEFAULT 0,
    status            text NOT NULL DEFAULT 'PENDING' CHECK (status IN ('PENDING', 'COMPLETED')),
    parent_run_id     text,
    idempotency_key   text,
    created_at        timestamptz NOT NULL DEFAULT now(),
    completed_at      timestamptz
);
CREATE UNIQUE INDEX batch_idempotency_uq ON batch_task_run (environment_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

CREATE TABLE task_run_checkpoint (
    id                text PRIMARY KEY,
    run_id            text NOT NULL REFERENCES task_run(id) ON DELETE CASCADE,
    snapshot_id       text NOT NULL,
    type              text NOT NULL DEFAULT 'REPLAY' CHECK (type IN ('REPLAY')),
    journal_position  integer NOT NULL DEFAULT 0,
    created_at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX checkpoint_run ON task_run_checkpoint (run_id);

CREATE TABLE task_run_journal (
    run_id      text NOT NULL REFERENCES task_run(id) ON DELETE CASCADE,
    sequence    integer NOT NULL,
    kind        text NOT NULL CHECK (kind IN ('step', 'wait', 'child', 'batch', 'token')),
    key         text NOT NULL,
    result      jsonb,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, sequence)
);

CREATE TABLE task_schedule (
    id                text PRIMARY KEY,
    environment_id    text NOT NULL REFERENCES runtime_environment(id) ON DELETE CASCADE,
    task_identifier   text NOT NULL,
    cron              text NOT NULL,
    timezone          text NOT NULL DEFAULT 'UTC',
    external_id       text,
    deduplication_key text,
    active            boolean NOT NULL DEFAULT true,
    next_run_at       timestamptz,
    last_run_at       timestamptz,
    created_at        timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX task_schedule_dedup_uq ON task_schedule (environment_id, deduplication_key)
    WHERE deduplication_key IS NOT NULL;

-- dex-style leader lease; unlogged: a crash loses it, which only means a new election
CREATE UNLOGGED TABLE engine_lease (
    name         text PRIMARY KEY,
    holder       text NOT NULL,
    acquired_at  timestamptz NOT NULL,
    expires_at   timestamptz NOT NULL
);

-- key/value settings of the installation (generated secret, …)
CREATE TABLE engine_setting (
    key    text PRIMARY KEY,
    value  text NOT NULL
);
