-- Waitpoints and journal replay (issue 4).

-- the waitpoint a journaled wait blocked on (wait, token, child, batch entries)
ALTER TABLE task_run_journal ADD COLUMN waitpoint_id text;

-- the sweeper's look-ups: pending RUN / BATCH waitpoints, and runs shown as WAITING
CREATE INDEX waitpoint_pending ON waitpoint (type, created_at) WHERE status = 'PENDING';
CREATE INDEX task_run_waiting ON task_run (id) WHERE status = 'WAITING';
CREATE INDEX waitpoint_completed_by_batch ON waitpoint (completed_by_batch_id) WHERE completed_by_batch_id IS NOT NULL;
CREATE INDEX waitpoint_env_status ON waitpoint (environment_id, type, status, created_at DESC, id DESC);
