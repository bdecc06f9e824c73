-- include: jobs_lib
-- jobs_settle: finish a claimed job, only if it was not replaced meanwhile (same token).
-- KEYS[1] J:items
-- ARGV[1] J, ARGV[2] id, ARGV[3] token, ARGV[4] action: 'complete' | 'retry' | 'dead'
-- ARGV[5] new job JSON (retry, dead), ARGV[6] run-at ms (retry)
-- returns: 1 when applied, 0 when the job was replaced or is gone
local id = ARGV[2]
local item = redis.call('HGET', ITEMS, id)
if not item then return 0 end
if cjson.decode(item)['token'] ~= ARGV[3] then return 0 end
if ARGV[4] == 'complete' then
  remove(id)
elseif ARGV[4] == 'retry' then
  redis.call('HSET', ITEMS, id, ARGV[5])
  local lane = lane_of(id)
  local at = tonumber(ARGV[6])
  redis.call('ZADD', lane_key(lane), at, id)
  wake_lane(lane, at)
else
  remove(id)
  redis.call('HSET', J .. ':dlq', id, ARGV[5])
end
return 1
