-- no-transaction
-- The runs of a tag were found through a GIN index over every environment's tags: the entry of a
-- tag as common as "prod" listed every tenant's runs of it, so a tenant with a million runs tagged
-- "prod" made every other tenant's query for its own "prod" runs read and recheck all of them (a
-- noisy neighbour through a shared index). Each tag is now keyed by its environment
-- (`environment_id || chr(31) || tag`; an id never holds that character), so a query reads its own
-- environment's entries only. Without GIN's pending list (fastupdate): every query would read the
-- list of every tenant's tagged runs inserted since the last vacuum (up to 4 MB). Built without
-- blocking writes, and never dropped with a lock that would: this migration runs again only when
-- it was interrupted, and then whatever a build left (an invalid index, or a valid one not yet
-- recorded) is dropped CONCURRENTLY and built again; the old index goes once the new one is there.
CREATE OR REPLACE FUNCTION env_tags(env text, tags text[]) RETURNS text[]
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$ SELECT array_agg(env || chr(31) || t) FROM unnest(tags) AS t $$;
-- next
DROP INDEX CONCURRENTLY IF EXISTS task_run_env_tags;
-- next
CREATE INDEX CONCURRENTLY IF NOT EXISTS task_run_env_tags ON task_run USING gin (env_tags(environment_id, tags))
    WITH (fastupdate = off) WHERE tags <> '{}';
-- next
DROP INDEX CONCURRENTLY IF EXISTS task_run_tags;
