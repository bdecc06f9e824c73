-- 0004_input_limits (issue 10): a priority is up to 10 years of head start, which in milliseconds
-- does not fit a 32-bit integer.
ALTER TABLE task_run ALTER COLUMN priority_ms TYPE bigint;
