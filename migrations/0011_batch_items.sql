-- The indexes of a two-phase batch's items that have been triggered. An item may join a run that is
-- not the batch's own (its idempotency key or debounce key names a run of another batch), so the
-- batch is sealed when every index has been seen, not when it holds `size` runs of its own.
ALTER TABLE batch_task_run ADD COLUMN items_seen integer[] NOT NULL DEFAULT '{}';
