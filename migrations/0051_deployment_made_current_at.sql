-- When a deployment was last made current: by its first connect, by a connect that made it current
-- again, or by a promote (POST /api/v1/deployments/{version}/promote). A connect of a deployment
-- that is not current makes it current again only when no current deployment of its (environment,
-- worker group) was made current at or after it was: so a promote (a rollback to an older version)
-- sticks when the newer version's workers connect again, and an old worker reconnecting during a
-- rolling deploy still leaves the newer deployment current.
-- Rows from before: created_at, the order the connects used until now (a deployment was made current
-- by its first connect). Rows a process of the version before inserts (a rolling upgrade) get the
-- default, the clock of their insert: that process made them current then. Such a process still
-- decides a connect by created_at alone, and sets no made_current_at when a connect makes an older
-- deployment current again: during the upgrade a worker of a newer version than a promoted one may
-- make its deployment current again through it, as before this column.
-- deployment holds a few rows per environment and worker group (one per version): the backfill and
-- NOT NULL read it whole, under the lock ADD COLUMN takes for the transaction (no insert in between).
ALTER TABLE deployment ADD COLUMN IF NOT EXISTS made_current_at timestamptz;
UPDATE deployment SET made_current_at = created_at WHERE made_current_at IS NULL;
ALTER TABLE deployment ALTER COLUMN made_current_at SET DEFAULT clock_timestamp();
ALTER TABLE deployment ALTER COLUMN made_current_at SET NOT NULL;
