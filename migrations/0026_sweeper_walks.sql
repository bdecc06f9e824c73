-- no-transaction
-- The waitpoint sweeper (every few seconds) read every WAITING run and every pending RUN waitpoint
-- of every tenant at each pass: 1.4 s of PostgreSQL with 300,000 waiting runs, every 5 s. It now
-- walks them a slice at a time from where its last pass stopped: the waiting runs by
-- task_run_waiting (id), the pending RUN waitpoints by this index. Built without blocking writes; an
-- index left invalid by an interrupted build is built again.
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
             WHERE c.relname = 'waitpoint_runs_to_sweep' AND NOT i.indisvalid) THEN
    DROP INDEX waitpoint_runs_to_sweep;
  END IF;
END $$;
-- next
CREATE INDEX CONCURRENTLY IF NOT EXISTS waitpoint_runs_to_sweep ON waitpoint (id) WHERE status = 'PENDING' AND type = 'RUN';
