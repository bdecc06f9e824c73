-- A run's snapshots go with the run without a foreign key: the key's check ran once per snapshot
-- appended (four or more per run, each a look-up and a row lock on the run: a tenth of
-- PostgreSQL's CPU on the hot path), and nothing else needs it. Snapshots are appended only by
-- statements that read the run's latest snapshot or insert the run itself; a statement-level
-- trigger deletes the snapshots of deleted runs (retention, an environment's cascade) in one pass.
ALTER TABLE task_run_execution_snapshot DROP CONSTRAINT IF EXISTS task_run_execution_snapshot_run_id_fkey;

CREATE FUNCTION task_run_delete_snapshots() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- by run id through snapshot_run_seq, whatever the number of runs (a join with the transition
    -- table, which has no statistics, could be planned as a scan of every snapshot)
    DELETE FROM task_run_execution_snapshot WHERE run_id = ANY (ARRAY(SELECT id FROM gone));
    RETURN NULL;
END
$$;

CREATE TRIGGER task_run_snapshots_deleted AFTER DELETE ON task_run
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION task_run_delete_snapshots();
