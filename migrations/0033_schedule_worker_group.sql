-- A declarative schedule belongs to the worker group whose deployment declared it: an environment has
-- a current deployment per worker group, and one group's deployment without the task deleted another
-- group's declared crons (they came back only at that group's next connect, their ticks lost
-- meanwhile); and its ticks' runs go to that group, not to the environment's default group, which
-- may not have the task (each tick left one more run waiting for a version). The schedules declared
-- before are given the group whose current deployment has the task (the environment's default group
-- first). A group deleted: its schedules' runs go to the default group again.
ALTER TABLE task_schedule ADD COLUMN IF NOT EXISTS worker_group_id text REFERENCES worker_group(id) ON DELETE SET NULL;
UPDATE task_schedule s SET worker_group_id = (
    SELECT d.worker_group_id FROM deployment d
    JOIN deployment_task dt ON dt.deployment_id = d.id
    JOIN runtime_environment e ON e.id = d.environment_id
    WHERE d.environment_id = s.environment_id AND d.is_current AND dt.task_identifier = s.task_identifier
    ORDER BY d.worker_group_id IS NOT DISTINCT FROM e.default_worker_group_id DESC, d.created_at DESC
    LIMIT 1)
WHERE s.type = 'DECLARATIVE' AND s.worker_group_id IS NULL;
