-- include: jobs_lib
-- jobs_settle: finish claimed jobs, each only if it was not replaced meanwhile (same token).
-- KEYS[1] J:items
-- ARGV[1] J, then per job 5 fields: id, token, action ('complete' | 'retry' | 'dead'), new job JSON
--   (retry, dead; else ''), run-at ms (retry; else 0)
-- returns: per job 1 when applied, 0 when the job was replaced or is gone
local out = {}
for i = 2, #ARGV, 5 do
  local id, token, action = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local item = redis.call('HGET', ITEMS, id)
  if not item or cjson.decode(item)['token'] ~= token then
    out[#out + 1] = 0
  else
    if action == 'complete' then
      remove(id)
    elseif action == 'retry' then
      redis.call('HSET', ITEMS, id, ARGV[i + 3])
      local lane = lane_of(id)
      local at = tonumber(ARGV[i + 4])
      redis.call('ZADD', lane_key(lane), at, id)
      wake_lane(lane, at)
      rescore(lane)
    else
      remove(id)
      redis.call('HSET', J .. ':dlq', id, ARGV[i + 3])
    end
    out[#out + 1] = 1
  end
end
return out
