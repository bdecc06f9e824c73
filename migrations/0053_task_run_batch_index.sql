-- The index a run was triggered as in its streamed batch (`POST /api/v3/batches/{batchId}/items`):
-- an index makes one run of its batch whatever its task, key or TTL. Its idempotency key could not
-- say so: `<batch>:<index>` is a key of its task only (an index sent again as another task missed
-- it) and an item with a key of its own has no index in it. A retried stream looks up the batch's
-- runs by it (`batch_id` = the batch: its rows are found by task_run_batch), and a failure noted for
-- an index that has its run is not kept. NULL for every other run, and for runs a process of the
-- version before makes (a rolling upgrade: as before). Nullable, no default: no table rewrite.
ALTER TABLE task_run ADD COLUMN IF NOT EXISTS batch_index integer;
