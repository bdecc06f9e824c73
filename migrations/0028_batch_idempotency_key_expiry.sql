-- A batch's idempotency key expires, as a run's does (Trigger.dev: 30 days unless the batch said
-- otherwise): a key reused after it opens a new batch instead of answering with the old one. The
-- keyed batches made before this migration keep their key 30 days from when they were made.
ALTER TABLE batch_task_run ADD COLUMN IF NOT EXISTS idempotency_key_expires_at timestamptz;
UPDATE batch_task_run SET idempotency_key_expires_at = created_at + interval '30 days'
WHERE idempotency_key IS NOT NULL AND idempotency_key_expires_at IS NULL;
