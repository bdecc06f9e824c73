-- include: jobs_lib
-- jobs_stats: jobs scheduled, the run-at ms of the earliest job nobody has claimed (false: none),
-- jobs in the job DLQ. Lanes looked at: the default one and the first 1,000 due by now (a lane
-- served while it had more due is scored at that claim's time).
-- KEYS[1] J:items
-- ARGV[1] J, ARGV[2] now ms
local earliest = false
local function consider(key)
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  if first[1] then
    local at = tonumber(first[2])
    if not earliest or at < earliest then earliest = at end
  end
end
consider(lane_key(''))
for _, lane in ipairs(redis.call('ZRANGEBYSCORE', LANES, '-inf', '(' .. (tonumber(ARGV[2]) + 1), 'LIMIT', 0, 1000)) do
  consider(lane_key(lane))
end
return {redis.call('HLEN', ITEMS), earliest, redis.call('HLEN', J .. ':dlq')}
