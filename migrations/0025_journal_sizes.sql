-- What a journal read returns is bounded in bytes (a page; the executor asks for the next one when
-- its replay gets there): a task that waited five thousand times on one completed token of 3 MiB
-- made every read of its journal 15 GB, in the server that serves every tenant. A page is cut by
-- the sizes recorded here when a value is written, never by measuring (detoasting) the values
-- themselves: an entry's own result (a step's) and a waitpoint's output, as JSON text. NULL: written
-- before this migration, measured when read.
ALTER TABLE waitpoint ADD COLUMN IF NOT EXISTS output_bytes integer;
ALTER TABLE task_run_journal ADD COLUMN IF NOT EXISTS result_bytes integer;
