-- jobs_schedule: create or replace engine jobs (same id replaces payload, time and token).
-- KEYS[1] due ZSET (id -> run-at ms), KEYS[2] items HASH (id -> job JSON)
-- ARGV: triples of id, run_at_ms, job_json
-- returns: number of jobs written
for i = 1, #ARGV, 3 do
  redis.call('ZADD', KEYS[1], ARGV[i + 1], ARGV[i])
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 2])
end
return #ARGV / 3
