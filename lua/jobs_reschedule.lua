-- include: jobs_lib
-- jobs_reschedule: move existing jobs to a new time; absent ids are left absent (heartbeats).
-- KEYS[1] J:items
-- ARGV[1] J, ARGV[2] now ms, then pairs of id, run_at_ms
-- returns: array of 1 (moved) / 0 (no such job), one per pair
local now = tonumber(ARGV[2])
local out = {}
for i = 3, #ARGV, 2 do
  local lane = lane_of(ARGV[i])
  local key = lane_key(lane)
  if redis.call('ZSCORE', key, ARGV[i]) then
    local at = tonumber(ARGV[i + 1])
    redis.call('ZADD', key, at, ARGV[i])
    wake_lane(lane, math.max(at, now))
    rescore(lane)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
