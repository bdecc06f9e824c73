-- Cron schedules (issue 5): the planner's look-up of due schedules, and where a schedule came from.
ALTER TABLE task_schedule ADD COLUMN type text NOT NULL DEFAULT 'IMPERATIVE' CHECK (type IN ('IMPERATIVE', 'DECLARATIVE'));
ALTER TABLE task_schedule ADD COLUMN updated_at timestamptz NOT NULL DEFAULT now();
CREATE INDEX task_schedule_due ON task_schedule (next_run_at) WHERE active;
CREATE INDEX task_schedule_env ON task_schedule (environment_id, created_at DESC, id DESC);
