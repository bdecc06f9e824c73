-- jobs_claim: atomically lease due jobs: their score becomes now + visibility timeout, so a
-- consumer that dies lets them be delivered again.
-- KEYS[1] due ZSET, KEYS[2] items HASH
-- ARGV[1] now_ms, ARGV[2] limit, ARGV[3] visibility_ms
-- returns: flat array id1, job_json1, id2, job_json2, ...
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
local out = {}
local lease = tonumber(ARGV[1]) + tonumber(ARGV[3])
for _, id in ipairs(ids) do
  local item = redis.call('HGET', KEYS[2], id)
  if item then
    redis.call('ZADD', KEYS[1], lease, id)
    out[#out + 1] = id
    out[#out + 1] = item
  else
    redis.call('ZREM', KEYS[1], id)  -- orphan
  end
end
return out
