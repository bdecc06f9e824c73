-- no-transaction
-- Retention deletes completed waitpoints older than its age: by their completion date among the
-- completed ones, instead of reading the whole table at every batch of a thousand runs deleted.
-- Built without blocking writes; an index left invalid by an interrupted build is built again.
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
             WHERE c.relname = 'waitpoint_completed_at' AND NOT i.indisvalid) THEN
    DROP INDEX waitpoint_completed_at;
  END IF;
END $$;
-- next
CREATE INDEX CONCURRENTLY IF NOT EXISTS waitpoint_completed_at ON waitpoint (completed_at) WHERE status = 'COMPLETED';
-- next
-- Finished runs for retention: those without an idempotency key by their finish, those with one by
-- the key's expiry (a run stays while its key holds: deleted, it would free the key). The runs kept
-- for their keys are then never walked again at every batch, as they were in one index by finish.
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
             WHERE c.relname IN ('task_run_finished_unkeyed', 'task_run_finished_keyed') AND NOT i.indisvalid) THEN
    DROP INDEX IF EXISTS task_run_finished_unkeyed;
    DROP INDEX IF EXISTS task_run_finished_keyed;
  END IF;
END $$;
-- next
CREATE INDEX CONCURRENTLY IF NOT EXISTS task_run_finished_unkeyed ON task_run (finished_at)
WHERE finished_at IS NOT NULL AND idempotency_key IS NULL;
-- next
CREATE INDEX CONCURRENTLY IF NOT EXISTS task_run_finished_keyed ON task_run (idempotency_key_expires_at)
WHERE finished_at IS NOT NULL AND idempotency_key IS NOT NULL;
-- next
DROP INDEX CONCURRENTLY IF EXISTS task_run_finished;
