-- jobs_settle: finish a claimed job, only if it was not replaced meanwhile (same token).
-- KEYS[1] due ZSET, KEYS[2] items HASH, KEYS[3] dlq HASH (id -> JSON with error)
-- ARGV[1] id, ARGV[2] token, ARGV[3] action: 'complete' | 'retry' | 'dead'
-- ARGV[4] new job JSON (retry, dead), ARGV[5] run-at ms (retry)
-- returns: 1 when applied, 0 when the job was replaced or is gone
local item = redis.call('HGET', KEYS[2], ARGV[1])
if not item then return 0 end
if cjson.decode(item)['token'] ~= ARGV[2] then return 0 end
if ARGV[3] == 'complete' then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
elseif ARGV[3] == 'retry' then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[4])
  redis.call('ZADD', KEYS[1], ARGV[5], ARGV[1])
else
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[4])
end
return 1
