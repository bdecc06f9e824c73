-- no-transaction
-- A run's valid snapshots form one chain: each follows exactly one other. Two transitions that read
-- the same latest snapshot at once (a run lock lost to a Redis failover or to its expiry, or a
-- transition that takes no lock) must not both append after it: with this unique index the second
-- one conflicts (the transition statements insert ON CONFLICT DO NOTHING and report the run as moved
-- on). A fork an earlier version may have left keeps only its newest branch valid (the run's latest
-- snapshot, the one every read goes by, never changes). Built without blocking writes; an index
-- left invalid by an interrupted build is dropped and built again.
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
             WHERE c.relname = 'snapshot_chain_uq' AND NOT i.indisvalid) THEN
    DROP INDEX snapshot_chain_uq;
  END IF;
END $$;
-- next
UPDATE task_run_execution_snapshot s SET is_valid = false
FROM (SELECT id, row_number() OVER (PARTITION BY previous_snapshot_id ORDER BY seq DESC) AS n
      FROM task_run_execution_snapshot WHERE is_valid AND previous_snapshot_id IS NOT NULL) d
WHERE s.id = d.id AND d.n > 1;
-- next
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS snapshot_chain_uq ON task_run_execution_snapshot (previous_snapshot_id)
WHERE is_valid AND previous_snapshot_id IS NOT NULL;
