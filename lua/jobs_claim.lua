-- include: jobs_lib
-- jobs_claim: atomically lease due jobs: their score becomes now + visibility timeout, so a
-- consumer that dies lets them be delivered again. The default lane's due jobs first (the engine's
-- checks of held runs), then the lanes with jobs due take turns, one job each per round, the lanes
-- served longest ago first: one environment's million delays due at once delay another's by one
-- job per round, not by a million.
-- KEYS[1] J:items
-- ARGV[1] J, ARGV[2] now_ms, ARGV[3] limit, ARGV[4] visibility_ms
-- returns: flat array id1, job_json1, id2, job_json2, ...
local now = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])
local lease = now + tonumber(ARGV[4])
local out = {}

-- lease job `id` of lane `key`; false when it was an orphan (no item: dropped)
local function take(key, id)
  local item = redis.call('HGET', ITEMS, id)
  if not item then
    redis.call('ZREM', key, id)
    redis.call('HDEL', LANE_OF, id)
    return false
  end
  redis.call('ZADD', key, lease, id)
  out[#out + 1] = id
  out[#out + 1] = item
  return true
end

local default = lane_key('')
for _, id in ipairs(redis.call('ZRANGEBYSCORE', default, '-inf', now, 'LIMIT', 0, limit)) do
  take(default, id)
end

local remaining = limit - #out / 2
if remaining <= 0 then return out end
-- due: scored before the next ms (a lane served in this ms has a fraction of it: see below)
local lanes = redis.call('ZRANGEBYSCORE', LANES, '-inf', '(' .. (now + 1), 'LIMIT', 0, remaining)
local active = lanes
while remaining > 0 and #active > 0 do
  local still = {}
  for _, lane in ipairs(active) do
    if remaining <= 0 then break end
    local key = lane_key(lane)
    local ids = redis.call('ZRANGEBYSCORE', key, '-inf', now, 'LIMIT', 0, 1)
    if ids[1] then
      if take(key, ids[1]) then remaining = remaining - 1 end
      still[#still + 1] = lane
    end
  end
  active = still
end
-- A lane with more due goes after every lane served before it: scored now plus its turn in this
-- claim in 1/1024ths of a ms (exact in a double at today's ms), so lanes served together keep
-- their order next time and claims within the same ms still see them.
for turn, lane in ipairs(lanes) do
  local first = redis.call('ZRANGE', lane_key(lane), 0, 0, 'WITHSCORES')
  if first[1] then
    local at = tonumber(first[2])
    if at <= now then at = now + math.min(turn, 1000) / 1024 end
    redis.call('ZADD', LANES, at, lane)
  else
    redis.call('ZREM', LANES, lane)
  end
end
return out
