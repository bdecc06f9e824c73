-- Who made a one-request batch with an idempotency key (POST /api/v1/tasks/batch, /api/v2/tasks/batch):
-- the identity of the credential that opened its row, so that the same caller's retry may make the runs a
-- first attempt that died between the row and its runs did not. 'pat:<digest>' for a public access
-- token (a digest of the token itself: another token, even of the same scopes, is another caller),
-- 'run:<run id>' for a run's token, NULL for the environment's secret key, which may complete any batch
-- of its environment. Rows from before this column, and rows a process of the version before writes
-- (a rolling upgrade), have NULL: for a caller holding a token that is "not this caller", so such a
-- batch is made whole by the secret key only, as before. Nullable, no default: no table rewrite.
ALTER TABLE batch_task_run ADD COLUMN IF NOT EXISTS made_by text;
