-- include: jobs_lib
-- jobs_apply: cancel some jobs and create or replace others, in one call (the engine re-arms a
-- run's timeout jobs on every state change, for many runs at once).
-- KEYS[1] J:items
-- ARGV[1] J, ARGV[2] now ms, ARGV[3] number of ids to cancel, then those ids, then quadruples of id,
--   run_at_ms, lane ('': the default lane), job_json
-- A job written is live again: a dead copy of its id (it failed every attempt before, and the
-- reconciler or the engine armed it again) leaves the job DLQ.
-- returns: number of jobs written
local now = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
for i = 4, n + 3 do
  remove(ARGV[i])
end
local written = 0
for i = n + 4, #ARGV, 4 do
  place(ARGV[i], ARGV[i + 2], tonumber(ARGV[i + 1]), now)
  redis.call('HSET', ITEMS, ARGV[i], ARGV[i + 3])
  redis.call('HDEL', J .. ':dlq', ARGV[i])
  written = written + 1
end
return written
