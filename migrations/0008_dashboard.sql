-- What the dashboard shows of a worker instance: the runs it takes at once (sent when it connects).
ALTER TABLE worker_instance ADD COLUMN concurrency integer CHECK (concurrency >= 0);
