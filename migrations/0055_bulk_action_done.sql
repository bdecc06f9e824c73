-- no-transaction
-- Retention deletes finished bulk actions older than its age by their completion among the finished
-- ones, instead of reading the whole table at each call (bulk_action had no index on completed_at;
-- every row past the age goes, so a call reads only what it deletes). Built without blocking
-- writes; an index left invalid by an interrupted build is built again.
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
             WHERE c.relname = 'bulk_action_done' AND NOT i.indisvalid) THEN
    DROP INDEX bulk_action_done;
  END IF;
END $$;
-- next
CREATE INDEX CONCURRENTLY IF NOT EXISTS bulk_action_done ON bulk_action (completed_at) WHERE status <> 'PENDING';
