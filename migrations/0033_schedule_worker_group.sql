-- A declarative schedule belongs to the worker group whose deployment declared it: an environment has
-- a current deployment per worker group, and one group's deployment without the task deleted another
-- group's declared crons (they came back only at that group's next connect, their ticks lost
-- meanwhile); and its ticks' runs go to that group, not to the environment's default group, which
-- may not have the task (each tick left one more run waiting for a version). The schedules declared
-- before are given the group whose current deployment has the task (the environment's default group
-- first: migration 0038, outside this transaction). A group deleted: its schedules' runs go to the
-- default group again.
ALTER TABLE task_schedule ADD COLUMN IF NOT EXISTS worker_group_id text REFERENCES worker_group(id) ON DELETE SET NULL;
