-- jobs_lib: helpers shared by the jobs_*.lua scripts (put in front of each by `-- include:`).
-- Every key lives under J = '<prefix>:jobs:{jobs}' (a hash tag: one cluster slot), given in ARGV[1]
-- (KEYS[1] is J:items, for routing). Layout:
--   J:due            ZSET  id -> run-at ms: the default lane, claimed first: the engine's own checks of
--                          held runs (heartbeat timeouts, max durations: as many as runs are held) and
--                          the sweeper
--   J:lane:<lane>    ZSET  id -> run-at ms: one environment's jobs (delays, TTLs, waitpoint dates and
--                          timeouts, bulk actions: as many as its triggers make)
--   J:lanes          ZSET  lane -> ms it is next looked at: its first job's time, or, served while it
--                          had more jobs due, the claim's time and its turn in it (lanes with jobs
--                          due take turns, the one served longest ago first)
--   J:lane_of        HASH  id -> lane, for the jobs of a lane other than the default one
--   J:items          HASH  id -> job JSON;  J:dlq  HASH id -> job JSON with its error and dead_at ms
-- A claimed job stays in its lane, scored at its lease's end.
local J = ARGV[1]
local LANES = J .. ':lanes'
local LANE_OF = J .. ':lane_of'
local ITEMS = J .. ':items'

local function lane_key(lane)
  if lane == '' then return J .. ':due' end
  return J .. ':lane:' .. lane
end

local function lane_of(id)
  return redis.call('HGET', LANE_OF, id) or ''
end

-- the lane has a job due at `at` ms: look at it then, unless it is to be looked at sooner
local function wake_lane(lane, at)
  if lane ~= '' then redis.call('ZADD', LANES, 'LT', at, lane) end
end

-- the lane's jobs changed (one left, or moved later): it is never looked at before its first job is
-- due (a claim would spend a look on it for nothing), and it goes when it has none
local function rescore(lane)
  if lane == '' then return end
  local first = redis.call('ZRANGE', lane_key(lane), 0, 0, 'WITHSCORES')
  if not first[1] then
    redis.call('ZREM', LANES, lane)
    return
  end
  local cur = redis.call('ZSCORE', LANES, lane)
  if not cur or tonumber(cur) < tonumber(first[2]) then redis.call('ZADD', LANES, first[2], lane) end
end

-- put job `id` in `lane` at `at` ms (out of the lane it was in, if another). A job of a lane is also
-- taken out of the default one: a process of the version before lanes may have written it there.
local function place(id, lane, at, now)
  local was = lane_of(id)
  if was ~= lane then
    redis.call('ZREM', lane_key(was), id)
    rescore(was)
    if lane == '' then redis.call('HDEL', LANE_OF, id) else redis.call('HSET', LANE_OF, id, lane) end
  end
  if lane ~= '' then redis.call('ZREM', lane_key(''), id) end
  redis.call('ZADD', lane_key(lane), at, id)
  wake_lane(lane, math.max(at, now))
  rescore(lane)
end

-- forget job `id` (its lane's entry, a copy in the default lane, its item)
local function remove(id)
  local lane = lane_of(id)
  redis.call('ZREM', lane_key(lane), id)
  redis.call('HDEL', ITEMS, id)
  if lane ~= '' then
    redis.call('ZREM', lane_key(''), id)
    redis.call('HDEL', LANE_OF, id)
    rescore(lane)
  end
end
