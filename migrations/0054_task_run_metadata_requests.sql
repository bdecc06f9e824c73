-- The requests that changed a run's metadata by operations (`PUT /api/v1/runs/{runId}/metadata`
-- with an `Idempotency-Key`: the SDK's flushes), the last 8, oldest first, each
-- `<digest of its body>:<key>`: written in the transaction that applies the request's operations
-- (on the run's own row, locked first), so that a request sent again after its answer was lost is
-- answered with the metadata as it is, its operations (increments, appends, on the run, its parent
-- and its root) not applied twice. NULL for a run no such request changed. Nullable, no default: no
-- table rewrite; a process of the version before neither reads nor writes it (a rolling upgrade:
-- its requests apply as before).
ALTER TABLE task_run ADD COLUMN IF NOT EXISTS metadata_requests text[];
