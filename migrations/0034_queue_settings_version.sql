-- A queue's settings (limits, override, rate limit, pause) carry a version, moved on by every change
-- that changes them, whoever writes it (a trigger: a process of the version before this one too), and
-- carried into Redis with them: the run queue ignores a copy older than the one it has, so that a
-- process copying a row it read before an operator's pause or override (a trigger's first use of a
-- queue) cannot undo it there, and the reconciler finds the queues whose copy in Redis is behind (a
-- write to Redis that failed, or a process that died, after PostgreSQL's) by their version.
-- The version is PostgreSQL's clock in microseconds when the settings changed, and always more than
-- the one before: the reconciler reads the queues changed lately by it (task_queue_settings_version),
-- and a queue made again or a database restored from a backup still moves forward. Rows from before
-- have 0 (older than anything written from now on). task_queue holds settings, bounded by
-- RUN_ENGINE_MAX_QUEUES_PER_ENV a tenant; its index (task_queue_settings_version) is built without
-- blocking writes by migration 0038.
ALTER TABLE task_queue ADD COLUMN IF NOT EXISTS settings_version bigint NOT NULL DEFAULT 0;

CREATE OR REPLACE FUNCTION task_queue_settings_version() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    clock bigint := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
BEGIN
    IF TG_OP = 'INSERT' THEN
        NEW.settings_version := greatest(NEW.settings_version, clock);
    ELSIF (NEW.concurrency_limit, NEW.concurrency_limit_override, NEW.concurrency_key_limit, NEW.rate_limit,
           NEW.paused) IS DISTINCT FROM (OLD.concurrency_limit, OLD.concurrency_limit_override,
                                         OLD.concurrency_key_limit, OLD.rate_limit, OLD.paused) THEN
        NEW.settings_version := greatest(OLD.settings_version + 1, clock);
    ELSE
        NEW.settings_version := OLD.settings_version;
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS task_queue_settings_version ON task_queue;
CREATE TRIGGER task_queue_settings_version BEFORE INSERT OR UPDATE ON task_queue
    FOR EACH ROW EXECUTE FUNCTION task_queue_settings_version();

