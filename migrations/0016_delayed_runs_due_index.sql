-- no-transaction
-- The reconciler looks every pass for DELAYED runs whose date passed (their job lost): by date,
-- among the delayed runs only, instead of reading every DELAYED run and sorting them. Built without
-- blocking writes; an index left invalid by an interrupted build is built again.
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
             WHERE c.relname = 'task_run_delayed_due' AND NOT i.indisvalid) THEN
    DROP INDEX task_run_delayed_due;
  END IF;
END $$;
-- next
CREATE INDEX CONCURRENTLY IF NOT EXISTS task_run_delayed_due ON task_run (delay_until) WHERE status = 'DELAYED';
