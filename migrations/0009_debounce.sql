-- Debounce: a trigger with `debounce.key` joins the DELAYED run of (environment, task, key) if there
-- is one (pushing its date back, never past `debounce_deadline`: the first trigger + maxDelay)
-- instead of creating another. The unique partial index makes concurrent first triggers (any
-- number of server processes) create one run: the insert is ON CONFLICT DO NOTHING and the losers
-- join the winner's run. A run leaves the index when it leaves DELAYED (status is updated with
-- every snapshot), so the next trigger with the key then starts a new run.
ALTER TABLE task_run ADD COLUMN debounce_key text;
ALTER TABLE task_run ADD COLUMN debounce_deadline timestamptz;
CREATE UNIQUE INDEX task_run_debounce_uq ON task_run (environment_id, task_identifier, debounce_key)
    WHERE debounce_key IS NOT NULL AND status = 'DELAYED';
