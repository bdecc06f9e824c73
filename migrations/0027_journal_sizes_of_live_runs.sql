-- no-transaction
-- The sizes migration 0025 records, for what was written before it and is still read: the journals
-- of runs not finished and the waitpoints they name. Otherwise a journal page counts such a value
-- by its stored size (compressed: a repetitive 3 MiB output may take 30 KiB). Each statement is its
-- own short transaction.
UPDATE task_run_journal j SET result_bytes = coalesce(octet_length(j.result::text), 0)
FROM task_run r
WHERE r.id = j.run_id AND r.finished_at IS NULL AND j.result_bytes IS NULL;
-- next
UPDATE waitpoint w SET output_bytes = octet_length(w.output::text)
FROM (SELECT DISTINCT j.waitpoint_id FROM task_run_journal j JOIN task_run r ON r.id = j.run_id
      WHERE r.finished_at IS NULL AND j.waitpoint_id IS NOT NULL) live
WHERE w.id = live.waitpoint_id AND w.output_bytes IS NULL AND w.status = 'COMPLETED';
