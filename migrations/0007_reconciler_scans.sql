-- The reconciler's scans page by id through runs not finished, by status, and through pending
-- waitpoints an engine job completes: each page is a range of one of these indexes, whatever the
-- size of the finished history beside them.
CREATE INDEX task_run_unfinished ON task_run (status, id)
    WHERE status IN ('QUEUED', 'DELAYED', 'PENDING_VERSION', 'DEQUEUED', 'EXECUTING', 'WAITING');
CREATE INDEX waitpoint_timed ON waitpoint (id)
    WHERE status = 'PENDING' AND ((type = 'DATETIME' AND completed_after IS NOT NULL) OR timeout_at IS NOT NULL);
