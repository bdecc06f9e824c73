-- A batch opened for its items to come later (Trigger.dev's two-phase batch) says so: only such a
-- batch is PROCESSING while items are missing (a batch made in one request whose items all joined
-- other runs by their idempotency keys has no runs of its own, and is not waiting for any). Those
-- opened before this migration read as made in one request.
ALTER TABLE batch_task_run ADD COLUMN IF NOT EXISTS two_phase boolean NOT NULL DEFAULT false;
-- An environment's bulk actions, newest first (the SDK's runs.bulk.list), without reading every
-- tenant's: the table holds a few rows per environment, the index is built at once.
CREATE INDEX IF NOT EXISTS bulk_action_env_created ON bulk_action (environment_id, created_at DESC, id DESC);
