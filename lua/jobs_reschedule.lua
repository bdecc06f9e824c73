-- jobs_reschedule: move existing jobs to a new time; absent ids are left absent (heartbeats).
-- KEYS[1] due ZSET
-- ARGV: pairs of id, run_at_ms
-- returns: array of 1 (moved) / 0 (no such job), one per pair
local out = {}
for i = 1, #ARGV, 2 do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], ARGV[i + 1], ARGV[i])
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
