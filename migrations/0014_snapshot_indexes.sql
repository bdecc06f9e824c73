-- no-transaction
-- A run's snapshots by (run_id, seq) for every snapshot, not only the valid ones: the delete of a
-- run (retention) cascades to its snapshots by run_id, which the partial index could not serve
-- (a scan of the whole table per run deleted). The latest-snapshot look-ups (run_id, is_valid,
-- newest seq first) read the new index as they read the partial one. And snapshot_created goes:
-- no query reads it, and every snapshot written (four or more per run) paid for it. Built and
-- dropped without blocking writes; an index left invalid by an interrupted build is built again.
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
             WHERE c.relname = 'snapshot_run_seq' AND NOT i.indisvalid) THEN
    DROP INDEX snapshot_run_seq;
  END IF;
END $$;
-- next
CREATE INDEX CONCURRENTLY IF NOT EXISTS snapshot_run_seq ON task_run_execution_snapshot (run_id, seq DESC);
-- next
DROP INDEX CONCURRENTLY IF EXISTS snapshot_run_latest;
-- next
DROP INDEX CONCURRENTLY IF EXISTS snapshot_created;
