-- Retention keeps a completed waitpoint while a journal entry still names it (a live run replays
-- its result); this index answers that look-up.
CREATE INDEX task_run_journal_waitpoint ON task_run_journal (waitpoint_id) WHERE waitpoint_id IS NOT NULL;
