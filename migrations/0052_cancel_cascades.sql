-- The cancels of runs with children they wait on whose way down those children is not through
-- yet. A cancel of such a run writes its row before it cancels the run (and arms its job,
-- `cancel.<run>`), and deletes it once it reached the end of the runs below; a cancel that handed
-- the rest to its job leaves it to the job. The reconciler's re-arm walks these rows (by run id,
-- a budget a pass) and arms again the job of any whose job Redis no longer holds: one that failed
-- every attempt (the job DLQ: a PostgreSQL outage longer than its retries) or was lost with
-- Redis's data. Before, nothing armed it again, and the children stayed running or queued for good.
-- A row goes with its run (retention). Few rows: a cancel's, for as long as its cascade lasts.
CREATE TABLE IF NOT EXISTS cancel_cascade (
    run_id     text PRIMARY KEY REFERENCES task_run(id) ON DELETE CASCADE,
    created_at timestamptz NOT NULL DEFAULT now()
);
-- The cascades left unfinished before this table: cancelled runs with a child they wait on not
-- finished. (A child below a cancelled child is its parent's: that parent is one of these.) It
-- reads the runs not finished once; a cascade under way beside it (a process of the version
-- before) is found too, and its job re-armed only when Redis lost it.
INSERT INTO cancel_cascade (run_id)
SELECT DISTINCT child.parent_run_id
FROM task_run child JOIN task_run parent ON parent.id = child.parent_run_id
WHERE child.finished_at IS NULL AND child.resume_parent_on_completion AND parent.status = 'CANCELED'
ON CONFLICT DO NOTHING;
