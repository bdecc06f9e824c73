-- include: queue_lib
-- queue_config: change an environment's or a queue's settings and put back in the dequeue indexes
-- whatever was parked for the old setting (raising a limit or resuming takes effect at once;
-- lowering one or pausing takes effect at the next dequeue, which parks what it finds blocked).
-- KEYS[1] B:delayed (declares the shard's slot)
-- ARGV[1] B, ARGV[2] op, ARGV[3] env, ARGV[4] queue ('' for env_limit), ARGV[5] value ('' = unset)
--   ops: env_limit | queue_limit (each concurrency key's) | key_limit (each key's, when lower) |
--   queue_cap (all the queue's keys' together) | pause | resume | rate_limit (value "T,tau,T_us,tau_us":
--   the GCRA's emission interval and burst tolerance in whole ms, rounded down, for the dequeue of the
--   version before (rate_t, rate_tau), then in µs, the interval rounded up, for this one's
--   (rate_t_us, rate_tau_us, and rate_us_for: "T,tau", the ms they go with); '' = none)
--   op settings: every setting of a queue at once, ARGV[5] its version in PostgreSQL ('' = none),
--   ARGV[6] limit, ARGV[7] key limit, ARGV[8] rate (as rate_limit's value), ARGV[9] paused ('1'/'0'),
--   ARGV[10] '1' for a repair, ARGV[11] cap (as queue_cap's value). The version is kept in the
--   queue's meta (`sv`); settings older than it are ignored, and so are settings of the same version
--   but for a repair (the reconciler's, which found the queue's settings unlike PostgreSQL's at that
--   version: written by a process of the version before this one, which knows no versions)
-- returns: 1 (settings: 0 when ignored)
local op, env, q, value = ARGV[2], ARGV[3], ARGV[4], ARGV[5]

local function put(hkey, field, v)
  if v == '' then redis.call('HDEL', hkey, field) else redis.call('HSET', hkey, field, v) end
end

local RATE = '^(%d+),(%d+),(%d+),(%d+)$'

local function parse_rate(v)
  if v == '' then return true end
  return string.match(v, RATE)
end

local function set_rate(qm, v)
  if v == '' then
    redis.call('HDEL', qm, 'rate_t', 'rate_tau', 'tat', 'rate_t_us', 'rate_tau_us', 'rate_us_for', 'tat_us')
    return
  end
  local t, tau, t_us, tau_us = string.match(v, RATE)
  local was = redis.call('HMGET', qm, 'rate_t', 'rate_tau', 'rate_t_us', 'rate_tau_us', 'rate_us_for')
  -- the µs fields with the ms ones they go with (see rate_us_holds in queue_lib)
  redis.call('HSET', qm, 'rate_t', t, 'rate_tau', tau, 'rate_t_us', t_us, 'rate_tau_us', tau_us,
             'rate_us_for', t .. ',' .. tau)
  -- a new rate starts afresh: the arrival time the old one reached (a day ahead, for one a day)
  -- would hold the queue back by the old rate (the same rate set again keeps it, and so does one
  -- that the version before set, without its µs fields or with µs fields it made stale)
  local held_us = was[3] and rate_us_holds(was[1], was[2], was[5])
  if was[1] ~= t or was[2] ~= tau or (held_us and (was[3] ~= t_us or was[4] ~= tau_us)) then
    redis.call('HDEL', qm, 'tat', 'tat_us')
  end
end

-- keys put back by this call at most (the rest by the shard's next dequeue calls: unpark_pending)
local KEYS_AT_ONCE = 1000

-- each concurrency key's limit, as the dequeue reads it from the queue's meta: the queue's limit, or
-- its key limit when lower (nil: none)
local function key_cap_of(env, q)
  local meta = redis.call('HMGET', qkey(env, q) .. ':meta', 'limit', 'key_limit')
  local cap, key_limit = tonumber(meta[1]), tonumber(meta[2])
  if key_limit and (not cap or key_limit < cap) then cap = key_limit end
  return cap
end

-- The keys parked at their limit are put back only when each key's limit rose (or went): at the
-- same limit or a lower one they are still blocked, and putting back every one (a queue's settings
-- are written again at each deploy, by a repair, by any other change) had the group's next
-- dequeue calls spend their budget parking them again: with thousands of keys, seconds of calls
-- that handed nothing to any tenant of the group. A slot freed still puts its own key back.
local function unpark_keys_if_raised(env, q, before)
  local after = key_cap_of(env, q)
  if before ~= nil and (after == nil or after > before) then unpark_keys(env, q, KEYS_AT_ONCE) end
end

-- The fields of a queue's rate limit as they stand (a queue parked for its rate keeps its time
-- until a write changes any of them: set_rate drops the arrival time for a new rate)
local function rate_of(env, q)
  local got = redis.call('HMGET', qkey(env, q) .. ':meta', 'rate_t', 'rate_tau', 'rate_t_us', 'rate_tau_us',
                         'rate_us_for', 'tat', 'tat_us')
  for i = 1, 7 do got[i] = got[i] or '' end
  return table.concat(got, ',')
end

-- After a change of a queue's settings, the queue is put back in the indexes it was parked out of,
-- but not while the new settings still block it (paused, or a limit of 0 for every key, or its cap
-- reached: the dequeue parks it again at once, a candidate of its budget each; 10,000 paused queues
-- whose limit a deploy changed cost the group five dequeue calls of ~65 ms that handed no tenant
-- anything), nor in a group where it waits for its rate when the write left the rate as it was
-- (`rate_before`: rate_of before the write). A freed slot, a resume or a raise that unblocks it
-- still puts it back, and so does its rate's time (unpark_rated).
local function unpark_queue_unless_blocked(env, q, rate_before)
  local qk = qkey(env, q)
  local meta = redis.call('HMGET', qk .. ':meta', 'paused', 'limit', 'key_limit', 'cap')
  if meta[1] == '1' then return end
  local key_cap, key_limit, cap = tonumber(meta[2]), tonumber(meta[3]), tonumber(meta[4])
  if key_limit and (not key_cap or key_limit < key_cap) then key_cap = key_limit end
  if key_cap and key_cap <= 0 then return end
  if cap and redis.call('SCARD', qk .. ':running') >= cap then return end
  local rate_kept = rate_before ~= nil and rate_before == rate_of(env, q)
  local pk = qk .. ':parked'
  local wgs = redis.call('SMEMBERS', pk)
  for _, wg in ipairs(wgs) do
    if not (rate_kept and redis.call('ZSCORE', gkey(wg) .. ':rp', env .. '\0' .. q)) then
      redis.call('SREM', pk, wg)
      refresh_queue(wg, env, q)
    end
  end
end

if op == 'env_limit' then
  put(ekey(env) .. ':meta', 'limit', value)
  unpark_env(env)
elseif op == 'queue_limit' or op == 'key_limit' then
  -- each key's limit: its keys were parked at the old one (the queue too, at 0)
  local before, rate = key_cap_of(env, q), rate_of(env, q)
  put(qkey(env, q) .. ':meta', op == 'queue_limit' and 'limit' or 'key_limit', value)
  unpark_keys_if_raised(env, q, before)
  unpark_queue_unless_blocked(env, q, rate)
elseif op == 'queue_cap' then
  local rate = rate_of(env, q)
  put(qkey(env, q) .. ':meta', 'cap', value)
  unpark_queue_unless_blocked(env, q, rate)
elseif op == 'rate_limit' then
  if not parse_rate(value) then return redis.error_reply('rate_limit value must be "T,tau,T_us,tau_us"') end
  local rate = rate_of(env, q)
  set_rate(qkey(env, q) .. ':meta', value)
  -- parked ahead of the old rate: the next dequeue weighs it by the new one (the same rate set
  -- again keeps its time, and the queue stays parked until then)
  unpark_queue_unless_blocked(env, q, rate)
elseif op == 'pause' then
  redis.call('HSET', qkey(env, q) .. ':meta', 'paused', 1)
elseif op == 'resume' then
  local rate = rate_of(env, q)
  redis.call('HDEL', qkey(env, q) .. ':meta', 'paused')
  unpark_queue_unless_blocked(env, q, rate)
elseif op == 'settings' then
  if not parse_rate(ARGV[8]) then return redis.error_reply('settings rate must be "T,tau,T_us,tau_us"') end
  local qm = qkey(env, q) .. ':meta'
  if value ~= '' then
    local have = tonumber(redis.call('HGET', qm, 'sv') or '')
    local version = tonumber(value)
    if have and (version < have or (version == have and ARGV[10] ~= '1')) then return 0 end
    redis.call('HSET', qm, 'sv', value) -- as given: a double's text would round its digits
  end
  local before, rate = key_cap_of(env, q), rate_of(env, q)
  put(qm, 'limit', ARGV[6])
  put(qm, 'key_limit', ARGV[7])
  put(qm, 'cap', ARGV[11] or '')
  set_rate(qm, ARGV[8])
  if ARGV[9] == '1' then redis.call('HSET', qm, 'paused', 1) else redis.call('HDEL', qm, 'paused') end
  unpark_keys_if_raised(env, q, before)
  unpark_queue_unless_blocked(env, q, rate)
else
  return redis.error_reply('unknown op ' .. op)
end
return 1
