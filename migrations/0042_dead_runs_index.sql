-- no-transaction
-- The runs in the DLQ are the runs whose status is SYSTEM_FAILURE (the DLQ's move is the only way
-- a run gets it, and a redrive takes it away): after Redis lost its data the reconciler rebuilds
-- the DLQ from them, a page by id at a time. This index holds those runs only, so a page is a
-- range of it whatever the finished history beside them; no other status's write touches it
-- (status is indexed already by task_run_env_status: no update that was HOT stops being one).
-- Built without blocking writes; an index left invalid by an interrupted build is built again.
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
             WHERE c.relname = 'task_run_dead' AND NOT i.indisvalid) THEN
    DROP INDEX task_run_dead;
  END IF;
END $$;
-- next
CREATE INDEX CONCURRENTLY IF NOT EXISTS task_run_dead ON task_run (id) WHERE status = 'SYSTEM_FAILURE';
