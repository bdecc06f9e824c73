-- include: queue_lib
-- queue_config: change an environment's or a queue's settings and put back in the dequeue indexes
-- whatever was parked for the old setting (raising a limit or resuming takes effect at once;
-- lowering one or pausing takes effect at the next dequeue, which parks what it finds blocked).
-- KEYS[1] B:delayed (declares the shard's slot)
-- ARGV[1] B, ARGV[2] op, ARGV[3] env, ARGV[4] queue ('' for env_limit), ARGV[5] value ('' = unset)
--   ops: env_limit | queue_limit | key_limit | pause | resume | rate_limit (value "T,tau": emission
--   interval and burst tolerance in ms, '' = none)
-- returns: 1
local op, env, q, value = ARGV[2], ARGV[3], ARGV[4], ARGV[5]

local function put(hkey, field)
  if value == '' then redis.call('HDEL', hkey, field) else redis.call('HSET', hkey, field, value) end
end

if op == 'env_limit' then
  put(ekey(env) .. ':meta', 'limit')
  unpark_env(env)
elseif op == 'queue_limit' then
  put(qkey(env, q) .. ':meta', 'limit')
  unpark_queue(env, q)
elseif op == 'key_limit' then
  put(qkey(env, q) .. ':meta', 'key_limit')
  unpark_keys(env, q)
elseif op == 'rate_limit' then
  local qm = qkey(env, q) .. ':meta'
  if value == '' then
    redis.call('HDEL', qm, 'rate_t', 'rate_tau', 'tat')
  else
    local t, tau = string.match(value, '^(%d+),(%d+)$')
    if not t then return redis.error_reply('rate_limit value must be "T,tau"') end
    local was = redis.call('HMGET', qm, 'rate_t', 'rate_tau')
    redis.call('HSET', qm, 'rate_t', t, 'rate_tau', tau)
    -- a new rate starts afresh: the arrival time the old one reached (a day ahead, for one a day)
    -- would hold the queue back by the old rate (the same rate set again keeps it)
    if was[1] ~= t or was[2] ~= tau then redis.call('HDEL', qm, 'tat') end
  end
  unpark_queue(env, q) -- parked ahead of the old rate: the next dequeue weighs it by the new one
elseif op == 'pause' then
  redis.call('HSET', qkey(env, q) .. ':meta', 'paused', 1)
elseif op == 'resume' then
  redis.call('HDEL', qkey(env, q) .. ':meta', 'paused')
  unpark_queue(env, q)
else
  return redis.error_reply('unknown op ' .. op)
end
return 1
