-- include: queue_lib
-- queue_dequeue: hand up to `max` ready runs of worker group `wg` out fairly, taking a slot at
-- environment, queue and concurrency-key level atomically with removing each run.
--   environments: lowest virtual time first (start-time fair queuing; +1 per run served)
--   queues of an environment: oldest head (lowest score) first; paused or full ones skipped
--   keys of a queue: lowest virtual time first; full keys skipped
-- One run is taken per pass and the choice is made again, so environments and keys interleave.
-- A blocked env (at its limit), queue (paused or at its limit) or key (at its key limit) is parked:
-- taken out of the group's indexes until a slot frees or its settings change (see queue_lib), so
-- later calls never walk past it. A budget of candidates still bounds the work of one call.
-- A queue with a rate limit (GCRA: emission interval `rate_t` ms, burst tolerance `rate_tau` ms,
-- theoretical arrival time `tat`) is skipped, not parked, while it is ahead of its rate: time alone
-- frees it; the earliest such time is returned so that a long-poll can wake for it.
-- With environments given (ARGV[8..]), only their runs are handed out (a supervisor narrowed to
-- environments, or holding an environment's token): they are looked up in the group's index.
-- KEYS[1] B:delayed
-- ARGV[1] B, ARGV[2] wg, ARGV[3] now ms, ARGV[4] max runs, ARGV[5] promote limit,
-- ARGV[6] default env limit, ARGV[7] scan window, ARGV[8..] only these environments (optional)
-- returns: flat array of 7 fields per run: run, env, queue, ck, score, deliveries, task; then three
-- more: the earliest ms a skipped rate-limited queue may hand out a run ('' if none was skipped),
-- how many environments of the group still have ready runs on this shard (the caller weighs its
-- choice of shard by it, so that environments on different shards get even shares), and how many
-- of those are ones this call may serve (all of them, or those of ARGV[8..]): the caller's backlog
local wg, now, max = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local default_env_limit, window = tonumber(ARGV[6]), tonumber(ARGV[7])
promote(now, tonumber(ARGV[5]))

local g = gkey(wg)
local only = {}
for i = 8, #ARGV do only[#only + 1] = ARGV[i] end
local out = {}
local skip_env, skip_q, skip_k = {}, {}, {}
local rate_next = nil -- earliest time a skipped rate-limited queue may serve again
local budget = 2000 -- bounds the work of one call whatever the shape of the backlog

local function limit_of(hkey, field, default)
  local v = redis.call('HGET', hkey, field)
  if v then return tonumber(v) end
  return default
end

-- the first candidate of a ZSET (ascending) not in `skip`, scanning `window` at a time
local function first_free(zkey, skip, prefix)
  local offset = 0
  while budget > 0 do
    local items = redis.call('ZRANGE', zkey, offset, offset + window - 1, 'WITHSCORES')
    if #items == 0 then return nil end
    for i = 1, #items, 2 do
      budget = budget - 1
      if not skip[prefix .. items[i]] then return items[i], tonumber(items[i + 1]) end
    end
    offset = offset + window
  end
  return nil
end

local function pick_key(env, q)
  local r = rkey(wg, env, q)
  local qm = qkey(env, q) .. ':meta'
  local key_limit = limit_of(qm, 'key_limit', nil)
  while budget > 0 do
    local ck, kvt = first_free(r .. ':ks', skip_k, env .. '\0' .. q .. '\0')
    if not ck then return nil end
    if key_limit and redis.call('SCARD', qkey(env, q) .. ':k:' .. ck .. ':running') >= key_limit then
      park_key(wg, env, q, ck)
    else
      return ck, kvt
    end
  end
  return nil
end

local function pick_queue(env)
  local qs = g .. ':e:' .. env .. ':qs'
  while budget > 0 do
    local q = first_free(qs, skip_q, env .. '\0')
    if not q then return nil end
    local qm = qkey(env, q) .. ':meta'
    local meta = redis.call('HMGET', qm, 'paused', 'limit', 'rate_t', 'rate_tau', 'tat')
    local paused = meta[1] == '1'
    local limit = tonumber(meta[2])
    local rate_t, tat = tonumber(meta[3]), nil
    if rate_t then
      tat = math.max(tonumber(meta[5]) or 0, now)
      local allowed_at = tat - (tonumber(meta[4]) or 0)
      if allowed_at > now then
        if not rate_next or allowed_at < rate_next then rate_next = allowed_at end
        tat = false
      end
    end
    if paused or (limit and redis.call('SCARD', qkey(env, q) .. ':running') >= limit) then
      park_queue(wg, env, q)
    elseif tat == false then
      skip_q[env .. '\0' .. q] = true -- ahead of its rate
    else
      local ck, kvt = pick_key(env, q)
      if ck then return q, ck, kvt, tat and (tat + rate_t) end
      skip_q[env .. '\0' .. q] = true
    end
  end
  return nil
end

-- the environment with the lowest virtual time among those allowed
local function pick_env()
  if #only == 0 then return first_free(g .. ':envs', skip_env, '') end
  local best, best_vt = nil, nil
  for _, e in ipairs(only) do
    budget = budget - 1
    if not skip_env[e] then
      local vt = redis.call('ZSCORE', g .. ':envs', e)
      if vt and (not best or tonumber(vt) < best_vt) then best, best_vt = e, tonumber(vt) end
    end
  end
  return best, best_vt
end

while #out < max * 7 and budget > 0 do
  local env, evt = pick_env()
  if not env then break end
  local env_limit = limit_of(ekey(env) .. ':meta', 'limit', default_env_limit)
  local q, ck, kvt, next_tat = nil, nil, nil, nil
  if redis.call('SCARD', ekey(env) .. ':running') >= env_limit then
    park_env(wg, env)
  else
    q, ck, kvt, next_tat = pick_queue(env)
    if not q then skip_env[env] = true end -- only when the budget ran out
  end
  local r = q and rkey(wg, env, q)
  local popped = q and redis.call('ZPOPMIN', r .. ':k:' .. ck)
  local run, score = popped and popped[1], popped and popped[2]
  local mk = run and (B .. ':msg:' .. run)
  if q and (not run or redis.call('TYPE', mk).ok ~= 'hash') then
    -- an index entry with no ready run, or a run without its message: nothing to hand out. Drop
    -- it and choose again (never fail the call: writes made before an error would stay). A run
    -- popped here is found by the reconciler (PostgreSQL still has it QUEUED).
    if run then count_queued(env, q, -1) end
    refresh_key(wg, env, q, ck)
    q = nil
  end
  if q then
    local deliveries = redis.call('HINCRBY', mk, 'deliveries', 1)
    redis.call('HSET', mk, 'state', 'held', 'held_at', now)
    local task = redis.call('HGET', mk, 'task') or ''
    redis.call('SADD', ekey(env) .. ':running', run)
    redis.call('SADD', qkey(env, q) .. ':running', run)
    redis.call('SADD', qkey(env, q) .. ':k:' .. ck .. ':running', run)
    count_queued(env, q, -1)
    -- virtual times: the key and the env advance by one run; the clocks move to the served tag
    redis.call('ZADD', r .. ':ks', 'XX', kvt + 1, ck)
    if kvt > tonumber(redis.call('GET', r .. ':vt') or '0') then redis.call('SET', r .. ':vt', kvt) end
    redis.call('ZADD', g .. ':envs', 'XX', evt + 1, env)
    if evt > tonumber(redis.call('HGET', g .. ':meta', 'vt') or '0') then redis.call('HSET', g .. ':meta', 'vt', evt) end
    if next_tat then redis.call('HSET', qkey(env, q) .. ':meta', 'tat', next_tat) end
    refresh_key(wg, env, q, ck)
    for _, v in ipairs({run, env, q, ck, score, deliveries, task}) do out[#out + 1] = v end
  end
end
out[#out + 1] = rate_next and tostring(rate_next) or ''
local active = redis.call('ZCARD', g .. ':envs')
out[#out + 1] = active
local mine = active
if #only > 0 then
  mine = 0
  for _, e in ipairs(only) do
    if redis.call('ZSCORE', g .. ':envs', e) then mine = mine + 1 end
  end
end
out[#out + 1] = mine
return out
