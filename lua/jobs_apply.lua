-- jobs_apply: cancel some jobs and create or replace others, in one call (the engine re-arms a
-- run's timeout jobs on every state change, for many runs at once).
-- KEYS[1] due ZSET, KEYS[2] items HASH
-- ARGV[1] number of ids to cancel, then those ids, then triples of id, run_at_ms, job_json
-- returns: number of jobs written
local n = tonumber(ARGV[1])
for i = 2, n + 1 do
  redis.call('ZREM', KEYS[1], ARGV[i])
  redis.call('HDEL', KEYS[2], ARGV[i])
end
local written = 0
for i = n + 2, #ARGV, 3 do
  redis.call('ZADD', KEYS[1], ARGV[i + 1], ARGV[i])
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 2])
  written = written + 1
end
return written
