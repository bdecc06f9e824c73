-- The version a run was triggered with (the trigger option lockToVersion), NULL when it named none.
-- Such a run is locked to that version's deployment (locked_to_deployment_id) for good: a worker
-- that names its deployments at dequeue is handed it only when one of them is that deployment, and
-- it never waits as PENDING_VERSION for another one. A run without it is locked to the deployment
-- current when it was queued, which any worker whose deployment has the task may run (a rolling
-- deploy). Rows from before this column, and rows a process of the version before writes (a rolling
-- upgrade), have NULL: not locked, as before. Nullable, no default: no table rewrite.
ALTER TABLE task_run ADD COLUMN IF NOT EXISTS locked_to_version text;
