-- no-transaction
-- The runs a completed waitpoint unblocked are continued a page at a time, by run id
-- (`continue_blocked`): by (waitpoint, run) each page is a range of the index, where by waitpoint
-- alone every page read and sorted every run still blocked on it (40,000 waiting runs: 4 million
-- rows read). It serves every look-up by waitpoint, so the index by waitpoint alone goes. Built
-- without blocking writes; an index left invalid by an interrupted build is built again.
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
             WHERE c.relname = 'task_run_waitpoint_by_waitpoint_run' AND NOT i.indisvalid) THEN
    DROP INDEX task_run_waitpoint_by_waitpoint_run;
  END IF;
END $$;
-- next
CREATE INDEX CONCURRENTLY IF NOT EXISTS task_run_waitpoint_by_waitpoint_run ON task_run_waitpoint (waitpoint_id, run_id);
-- next
DROP INDEX CONCURRENTLY IF EXISTS task_run_waitpoint_waitpoint;
