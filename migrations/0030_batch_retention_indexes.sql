-- no-transaction
-- Retention deletes batches older than its age once none of their runs is left and nobody waits on
-- them: those without an idempotency key by their completion (or creation: a batch nobody waits on
-- is never marked completed), those with one by the key's expiry (a batch stays while its key
-- holds: deleted, it would free the key, and the same batch request would make its runs again). As
-- for runs, the batches kept for their keys are then not walked at every pass. Built without
-- blocking writes; an index left invalid by an interrupted build is built again.
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
             WHERE c.relname IN ('batch_done_unkeyed', 'batch_done_keyed') AND NOT i.indisvalid) THEN
    DROP INDEX IF EXISTS batch_done_unkeyed;
    DROP INDEX IF EXISTS batch_done_keyed;
  END IF;
END $$;
-- next
CREATE INDEX CONCURRENTLY IF NOT EXISTS batch_done_unkeyed ON batch_task_run ((coalesce(completed_at, created_at)))
WHERE idempotency_key IS NULL;
-- next
CREATE INDEX CONCURRENTLY IF NOT EXISTS batch_done_keyed ON batch_task_run (idempotency_key_expires_at)
WHERE idempotency_key IS NOT NULL;
