-- no-transaction
-- What migrations 0033 and 0034 leave to be done without holding their tables: each statement is its
-- own, so the planner and the schedule API are not blocked while the schedules are backfilled, nor
-- task_queue's writers (a trigger's first use of a queue) while its index is built.
-- The declarative schedules of the version before 0033 take the group whose current deployment has
-- their task, the environment's default group first (a schedule with none stays NULL: the default
-- group's, and any group's connect that no longer declares it drops it, as before).
UPDATE task_schedule s SET worker_group_id = (
    SELECT d.worker_group_id FROM deployment d
    JOIN deployment_task dt ON dt.deployment_id = d.id
    JOIN runtime_environment e ON e.id = d.environment_id
    WHERE d.environment_id = s.environment_id AND d.is_current AND dt.task_identifier = s.task_identifier
    ORDER BY d.worker_group_id IS NOT DISTINCT FROM e.default_worker_group_id DESC, d.created_at DESC
    LIMIT 1)
WHERE s.type = 'DECLARATIVE' AND s.worker_group_id IS NULL;
-- next
-- an index left invalid by an interrupted build is built again
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
             WHERE c.relname IN ('task_queue_settings_version', 'task_schedule_worker_group') AND NOT i.indisvalid) THEN
    DROP INDEX IF EXISTS task_queue_settings_version;
    DROP INDEX IF EXISTS task_schedule_worker_group;
  END IF;
END $$;
-- next
-- the reconciler reads the queues whose settings changed since its last pass by their version
CREATE INDEX CONCURRENTLY IF NOT EXISTS task_queue_settings_version ON task_queue (settings_version, id);
-- next
-- a worker group deleted sets its schedules' group to NULL (ON DELETE SET NULL): found by this index,
-- not by reading every schedule
CREATE INDEX CONCURRENTLY IF NOT EXISTS task_schedule_worker_group ON task_schedule (worker_group_id)
WHERE worker_group_id IS NOT NULL;
