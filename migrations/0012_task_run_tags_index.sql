-- no-transaction
-- The runs of a tag (GET /api/v1/runs?filter[tag]=, the realtime tag shapes, bulk actions by tag)
-- were found by scanning the environment's runs newest first: ~100 ms for a rare tag among 300,000
-- runs (bench/tag_query.py), re-read on every change by a realtime subscriber. A GIN index on the
-- tags of tagged runs only (untagged runs, most of them, cost nothing to insert). Built without
-- blocking writes (CONCURRENTLY, outside a transaction); an index left invalid by a build that was
-- interrupted is dropped and built again.
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
             WHERE c.relname = 'task_run_tags' AND NOT i.indisvalid) THEN
    DROP INDEX task_run_tags;
  END IF;
END $$;
-- next
CREATE INDEX CONCURRENTLY IF NOT EXISTS task_run_tags ON task_run USING gin (tags) WHERE tags <> '{}';
