-- include: jobs_lib
-- jobs_claim: atomically lease due jobs: their score becomes now + visibility timeout, so a
-- consumer that dies lets them be delivered again. The default lane's due jobs first (the engine's
-- checks of held runs), then the lanes with jobs due take turns, one job each per round, the lanes
-- served longest ago first: one environment's million delays due at once delay another's by one
-- job per round, not by a million. The claimer may bound what the lanes take: `lane_room` jobs of
-- them in all, and `lane_cap` in flight of one lane (its jobs in flight given), so that one
-- tenant's slow jobs cannot take every slot; a lane at its cap takes more only when every lane
-- with jobs due was served and room is left (one tenant alone goes as fast as the slots allow).
-- KEYS[1] J:items
-- ARGV[1] J, ARGV[2] now_ms, ARGV[3] limit, ARGV[4] visibility_ms, ARGV[5] lane_room (-1: no bound),
--   ARGV[6] lane_cap (-1: no bound), then pairs of lane, jobs of it in flight
-- returns: flat array id1, job_json1, lane1, id2, job_json2, lane2, ...
local now = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])
local lease = now + tonumber(ARGV[4])
local lane_room = tonumber(ARGV[5])
local lane_cap = tonumber(ARGV[6])
local busy, full = {}, 0
for i = 7, #ARGV, 2 do
  busy[ARGV[i]] = tonumber(ARGV[i + 1])
  if lane_cap >= 0 and busy[ARGV[i]] >= lane_cap then full = full + 1 end
end
local function room(lane)
  if lane_cap < 0 then return 1 end
  return lane_cap - (busy[lane] or 0)
end
local out = {}

-- lease job `id` of `lane`; false when it was an orphan (no item: dropped)
local function take(lane, id)
  local key = lane_key(lane)
  local item = redis.call('HGET', ITEMS, id)
  if not item then
    redis.call('ZREM', key, id)
    if lane ~= '' then redis.call('HDEL', LANE_OF, id) end
    return false
  end
  redis.call('ZADD', key, lease, id)
  out[#out + 1] = id
  out[#out + 1] = item
  out[#out + 1] = lane
  return true
end

local default = lane_key('')
local due_default = redis.call('ZRANGEBYSCORE', default, '-inf', now, 'WITHSCORES', 'LIMIT', 0, limit)
for i = 1, #due_default, 2 do
  local id = due_default[i]
  local lane = lane_of(id)
  if lane == '' then
    take('', id)
  else
    -- a job of a lane that a process of the version before lanes wrote here (its latest write):
    -- into its lane at this time
    redis.call('ZREM', default, id)
    redis.call('ZADD', lane_key(lane), due_default[i + 1], id)
    wake_lane(lane, math.max(tonumber(due_default[i + 1]), now))
  end
end

local remaining = limit - #out / 3
if lane_room >= 0 and lane_room < remaining then remaining = lane_room end
if remaining <= 0 then return out end
-- due: scored before the next ms (a lane served in this ms has a fraction of it: see below); a lane
-- at its cap is passed over and keeps its place
local looked, visited, seen = {}, {}, {}
local fetched = remaining + full
local due = redis.call('ZRANGEBYSCORE', LANES, '-inf', '(' .. (now + 1), 'LIMIT', 0, fetched)
for _, lane in ipairs(due) do
  if room(lane) > 0 and #looked < remaining then looked[#looked + 1] = lane end
end
-- in turn, one job of each lane a round; `over`: past the lanes' caps
local function rounds(active, over)
  while remaining > 0 and #active > 0 do
    local still = {}
    for _, lane in ipairs(active) do
      if remaining <= 0 then break end
      if not seen[lane] then
        seen[lane] = true
        visited[#visited + 1] = lane
      end
      local ids = redis.call('ZRANGEBYSCORE', lane_key(lane), '-inf', now, 'LIMIT', 0, 1)
      if ids[1] then
        local copy = redis.call('ZSCORE', default, ids[1])
        if copy then
          -- a process of the version before lanes wrote this job after this version did (which
          -- takes it out of the default lane): its time is the job's
          redis.call('ZREM', default, ids[1])
          redis.call('ZADD', lane_key(lane), copy, ids[1])
        elseif take(lane, ids[1]) then
          remaining = remaining - 1
          busy[lane] = (busy[lane] or 0) + 1
        end
        if over or room(lane) > 0 then still[#still + 1] = lane end
      end
    end
    active = still
  end
end
rounds(looked, false)
if remaining > 0 and #due < fetched and lane_cap >= 0 then
  -- every lane with jobs due was seen and served: room is left, which the lanes at their caps take
  local over = {}
  for _, lane in ipairs(due) do
    if room(lane) <= 0 then over[#over + 1] = lane end
  end
  rounds(over, true)
end
-- A lane visited with more due goes after every lane served before it: scored after the last
-- lane served in this ms, in its turn, in 1/1024ths of a ms (exact in a double at today's ms), so
-- lanes keep their order however many claims a ms makes, and claims within the ms still see them.
local last = redis.call('ZREVRANGEBYSCORE', LANES, '(' .. (now + 1), '-inf', 'WITHSCORES', 'LIMIT', 0, 1)
local base = now
if last[2] and tonumber(last[2]) > base then base = tonumber(last[2]) end
for turn, lane in ipairs(visited) do
  local first = redis.call('ZRANGE', lane_key(lane), 0, 0, 'WITHSCORES')
  if first[1] then
    local at = tonumber(first[2])
    if at <= now then at = math.min(base + turn / 1024, now + 1023 / 1024) end
    redis.call('ZADD', LANES, at, lane)
  else
    redis.call('ZREM', LANES, lane)
  end
end
return out
