-- jobs_ack: cancel pending jobs (or finish claimed ones regardless of token).
-- KEYS[1] due ZSET, KEYS[2] items HASH
-- ARGV: job ids
-- returns: number of jobs removed
local n = 0
for i = 1, #ARGV do
  n = n + redis.call('ZREM', KEYS[1], ARGV[i])
  redis.call('HDEL', KEYS[2], ARGV[i])
end
return n
