-- no-transaction
-- The planner takes the due ticks of each environment with due schedules (at most 20 of each, its
-- oldest first): by (environment, next tick) each environment's are the head of a range of the
-- index, where by next tick alone every environment's look-up walked every due schedule of every
-- environment (10 environments of 10,000 due schedules: a million rows read at every poll of every
-- process). Built without blocking writes; an index left invalid by an interrupted build is built again.
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
             WHERE c.relname = 'task_schedule_due_by_environment' AND NOT i.indisvalid) THEN
    DROP INDEX task_schedule_due_by_environment;
  END IF;
END $$;
-- next
CREATE INDEX CONCURRENTLY IF NOT EXISTS task_schedule_due_by_environment ON task_schedule (environment_id, next_run_at)
WHERE active;
