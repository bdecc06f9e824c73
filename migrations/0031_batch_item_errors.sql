-- The items of a two-phase batch that failed on their own (a streamed line that is not a valid
-- item, an item the engine refuses): their indexes are noted as sent (`items_seen`: the batch is
-- sealed without them) and counted as finished (`items_failed`: the batch completes once its runs
-- have), and each failure is kept for the batch's readers (`item_errors`, by index:
-- {taskIdentifier, error, errorCode}; GET /api/v2/batches/{id} answers them in processing.errors).
ALTER TABLE batch_task_run ADD COLUMN IF NOT EXISTS items_failed integer NOT NULL DEFAULT 0;
ALTER TABLE batch_task_run ADD COLUMN IF NOT EXISTS item_errors jsonb NOT NULL DEFAULT '{}';
