-- include: jobs_lib
-- jobs_settle: finish claimed jobs, each only if it was not replaced meanwhile (same token).
-- KEYS[1] J:items
-- ARGV[1] J, then per job 5 fields: id, token, action ('complete' | 'retry' | 'dead' | 'bury' |
--   'extend'), new job JSON (retry, dead, bury; else ''), run-at ms (retry; extend: the lease's new
--   end; else 0). 'bury': a job whose item is not
--   a job goes to the DLQ as the new JSON says; its "token" is the whole item as it was read.
-- returns: per job 1 when applied, 0 when the job was replaced or is gone
-- the token of a stored job (false: the item is not a job's)
local function token_of(item)
  local ok, data = pcall(cjson.decode, item)
  if ok and type(data) == 'table' and type(data['token']) == 'string' then return data['token'] end
  return false
end
local out = {}
for i = 2, #ARGV, 5 do
  local id, token, action = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local item = redis.call('HGET', ITEMS, id)
  if not item or (action == 'bury' and item ~= token) or (action ~= 'bury' and token_of(item) ~= token) then
    out[#out + 1] = 0
  else
    if action == 'complete' then
      remove(id)
    elseif action == 'extend' then  -- a job whose handler still runs keeps its lease
      local lane = lane_of(id)
      redis.call('ZADD', lane_key(lane), tonumber(ARGV[i + 4]), id)
      rescore(lane)
    elseif action == 'retry' then
      redis.call('HSET', ITEMS, id, ARGV[i + 3])
      local lane = lane_of(id)
      local at = tonumber(ARGV[i + 4])
      redis.call('ZADD', lane_key(lane), at, id)
      wake_lane(lane, at)
      rescore(lane)
    else  -- dead, bury
      remove(id)
      redis.call('HSET', J .. ':dlq', id, ARGV[i + 3])
    end
    out[#out + 1] = 1
  end
end
return out
