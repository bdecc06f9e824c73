-- no-transaction
-- The token list (`GET /api/v1/waitpoints/tokens`, newest first) walked every waitpoint of the
-- environment, its dates and runs waits included (a run's wait.for leaves one each), to find its
-- tokens: the tokens by environment, newest first, alone. Built without blocking writes; an index
-- left invalid by an interrupted build is built again.
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
             WHERE c.relname = 'waitpoint_tokens_env_created' AND NOT i.indisvalid) THEN
    DROP INDEX waitpoint_tokens_env_created;
  END IF;
END $$;
-- next
CREATE INDEX CONCURRENTLY IF NOT EXISTS waitpoint_tokens_env_created ON waitpoint (environment_id, created_at DESC, id DESC)
WHERE type = 'MANUAL';
