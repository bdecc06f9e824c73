-- no-transaction
-- A live realtime request reads the runs of its shape changed since its offset: by the environment's
-- runs in order of their last change, instead of every run of a tag (a million of them cost half a
-- second a read, at every change of the environment). Built without blocking writes; an index left
-- invalid by an interrupted build is built again.
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
             WHERE c.relname = 'task_run_env_updated' AND NOT i.indisvalid) THEN
    DROP INDEX task_run_env_updated;
  END IF;
END $$;
-- next
CREATE INDEX CONCURRENTLY IF NOT EXISTS task_run_env_updated ON task_run (environment_id, updated_at);
