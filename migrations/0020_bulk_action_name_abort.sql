-- Bulk actions as Trigger.dev's SDK makes them (runs.bulk.*): a name, and ABORTED (stopped by
-- the user before its last page). The table holds a few rows per environment: the check is
-- validated at once.
ALTER TABLE bulk_action ADD COLUMN IF NOT EXISTS name text;
ALTER TABLE bulk_action DROP CONSTRAINT IF EXISTS bulk_action_status_check;
ALTER TABLE bulk_action ADD CONSTRAINT bulk_action_status_check CHECK (status IN ('PENDING', 'COMPLETED', 'ABORTED'));
