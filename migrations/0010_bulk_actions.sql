-- Bulk actions: cancel or replay every run of an environment matching a filter, a page at a time
-- by an engine job; the cursor and the counts are the progress, readable while it runs.
CREATE TABLE bulk_action (
    id                text PRIMARY KEY,
    environment_id    text NOT NULL REFERENCES runtime_environment(id) ON DELETE CASCADE,
    kind              text NOT NULL CHECK (kind IN ('CANCEL', 'REPLAY')),
    filter            jsonb NOT NULL DEFAULT '{}',
    status            text NOT NULL DEFAULT 'PENDING' CHECK (status IN ('PENDING', 'COMPLETED')),
    cursor_created_at timestamptz,
    cursor_id         text,
    processed         integer NOT NULL DEFAULT 0,
    succeeded         integer NOT NULL DEFAULT 0,
    idempotency_key   text,
    created_at        timestamptz NOT NULL DEFAULT now(),
    completed_at      timestamptz
);
CREATE UNIQUE INDEX bulk_action_idempotency_uq ON bulk_action (environment_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX bulk_action_pending ON bulk_action (id) WHERE status = 'PENDING';
