-- A batch's item stream takes only a batch opened for its items (two_phase): a one-request batch's
-- id took streamed items too, each line one more run of that batch (it keeps no sent indexes).
-- The two-phase batches opened before 0021 read two_phase false; those whose items were noted
-- (until now only a two-phase batch's were) say so now, and keep taking their missing items.
UPDATE batch_task_run SET two_phase = true
WHERE NOT two_phase AND parent_run_id IS NULL AND cardinality(items_seen) > 0;
