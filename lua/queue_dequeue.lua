-- include: queue_lib
-- queue_dequeue: hand up to `max` ready runs of worker group `wg` out fairly, taking a slot at
-- environment, queue and concurrency-key level atomically with removing each run.
--   environments: lowest virtual time first (start-time fair queuing; +1 per run served)
--   queues of an environment: oldest head (lowest score) first; paused or full ones skipped
--   keys of a queue: lowest virtual time first; full keys skipped
-- One run is taken per pass and the choice is made again, so environments and keys interleave.
-- The queue's `limit` holds for each of its concurrency keys (runs without one are the key ''), as
-- Trigger.dev's concurrencyLimit does: a queue of limit 1 keyed by user runs one run of each user at
-- once, any number of users together (the environment's limit is the cap over all). `key_limit`, when
-- lower, holds for each key too; `cap`, when set, over all the queue's keys together (optional: none
-- by default). The version before read `limit` as that cap (it still does, in a rolling upgrade: the
-- stricter rule, meanwhile, where it dequeues).
-- A blocked env (at its limit), queue (paused, at its cap, or of limit 0) or key (at its limit) is
-- parked: taken out of the group's indexes until a slot frees or its settings change (see queue_lib),
-- so later calls never walk past it. A budget of candidates still bounds the work of one call.
-- A queue with a rate limit (GCRA: emission interval `rate_t_us`, burst tolerance `rate_tau_us`,
-- theoretical arrival time `tat_us`, in µs; in whole ms, 600 a second was 1,000 a second) is parked
-- while it is ahead of its rate, until the time it may serve again (the group's :rp, in ms;
-- unparked by the group's first dequeue from then on, 500 a call), so that thousands of queues
-- ahead of their rate cost later calls nothing (skipped, they took every call's budget, and their
-- environment, never served, stayed first: no run of any tenant of the group was handed out). The
-- earliest such time of the group is returned so that a long-poll can wake for it. `rate_t`,
-- `rate_tau` and `tat` are the same in ms, rounded down, as the version before this one reads and
-- writes them (a rolling upgrade): a queue it set has only those, the `tat` it writes counts here
-- too, as `tat_us` written here goes to its `tat`, and a rate it removes or changes, or a `tat` it
-- writes or deletes, makes the µs fields stale (see rate_us_holds): the fields in ms hold then.
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
local now_us = now * 1000 -- the rate limits' unit
local default_env_limit, window = tonumber(ARGV[6]), tonumber(ARGV[7])
promote(now, tonumber(ARGV[5]))
unpark_rated(wg, now, tonumber(ARGV[5]))
unpark_pending(tonumber(ARGV[5])) -- keys a raised limit is still putting back (queue_config)

local g = gkey(wg)
local only = {}
for i = 8, #ARGV do only[#only + 1] = ARGV[i] end
local out = {}
local skip_env, skip_q, skip_k = {}, {}, {}
local rate_next = nil -- earliest time a queue parked for its rate may serve again
local budget = 2000 -- bounds the work of one call whatever the shape of the backlog

local function limit_of(hkey, field, default)
  local v = redis.call('HGET', hkey, field)
  if v then return tonumber(v) end
  return default
end

-- What this call reads again and again is read once and kept up to date by its own writes (Redis
-- runs one script at a time: nothing else changes it meanwhile). Written through at once, but for
-- the queued counters, added up and written at the end.
local envs_seen = {}   -- env -> {limit, running}
local queues_seen = {} -- env\0q -> {paused, key_cap, cap, rate_t, rate_tau, tat (µs), running}
local keys_running = {} -- env\0q\0ck -> runs holding the key's slots (queues with a limit only)
local clocks = {}      -- a queue's or the group's key -> its virtual clock
local queued = {}      -- env\0q -> {env, q, delta}

local function env_seen(env)
  local e = envs_seen[env]
  if not e then
    e = {limit = limit_of(ekey(env) .. ':meta', 'limit', default_env_limit),
         running = redis.call('SCARD', ekey(env) .. ':running')}
    envs_seen[env] = e
  end
  return e
end

local function queue_seen(env, q)
  local id = env .. '\0' .. q
  local c = queues_seen[id]
  if not c then
    local qm = qkey(env, q) .. ':meta'
    local meta = redis.call('HMGET', qm, 'paused', 'limit', 'rate_t', 'rate_tau', 'tat', 'key_limit',
                            'rate_t_us', 'rate_tau_us', 'tat_us', 'cap', 'rate_us_for')
    -- each key's limit: the queue's, or its key limit when lower
    local key_cap, key_limit = tonumber(meta[2]), tonumber(meta[6])
    if key_limit and (not key_cap or key_limit < key_cap) then key_cap = key_limit end
    c = {paused = meta[1] == '1', key_cap = key_cap, cap = tonumber(meta[10])}
    -- µs fields the version before has made stale (its rate removed or changed, its `tat`) are
    -- dropped: the fields in ms hold (no `rate_t`: no rate limit)
    if meta[7] and not rate_us_holds(meta[3], meta[4], meta[11]) then
      redis.call('HDEL', qm, 'rate_t_us', 'rate_tau_us', 'rate_us_for')
      meta[7] = false
    end
    if meta[9] and not tat_us_holds(meta[5], meta[9]) then
      redis.call('HDEL', qm, 'tat_us')
      meta[9] = false
    end
    if meta[7] then
      c.rate_t, c.rate_tau = tonumber(meta[7]), tonumber(meta[8]) or 0
    elseif meta[3] then
      c.rate_t, c.rate_tau = tonumber(meta[3]) * 1000, (tonumber(meta[4]) or 0) * 1000
    end
    c.tat = tonumber(meta[9]) or (tonumber(meta[5]) or 0) * 1000
    if c.cap and not c.paused then c.running = redis.call('SCARD', qkey(env, q) .. ':running') end
    queues_seen[id] = c
  end
  return c
end

local function key_running(env, q, ck)
  local id = env .. '\0' .. q .. '\0' .. ck
  local n = keys_running[id]
  if not n then
    n = redis.call('SCARD', qkey(env, q) .. ':k:' .. ck .. ':running')
    keys_running[id] = n
  end
  return n
end

local function clock(key, read)
  local v = clocks[key]
  if not v then
    v = tonumber(read() or '0')
    clocks[key] = v
  end
  return v
end

local function add_queued(env, q, delta)
  local id = env .. '\0' .. q
  local c = queued[id]
  if c then c[3] = c[3] + delta else queued[id] = {env, q, delta} end
end

-- Where the next scan of a ZSET may start: every entry before it was skipped by this call. A
-- candidate returned is not passed (it may be parked, which removes it, or skipped). Serving a
-- candidate only moves it later (its head's score, its virtual time only grow), never before the
-- entries skipped; an index entry dropped is repaired with reads this call did not make, and every
-- scan starts from the top again.
local resume = {}

-- the first candidate of a ZSET (ascending) not in `skip`, scanning `window` at a time (from where
-- the last scan of it stopped: a long run of skipped entries is paid for once per call, not once
-- per candidate after it)
local function first_free(zkey, skip, prefix)
  local offset = resume[zkey] or 0
  while budget > 0 do
    local items = redis.call('ZRANGE', zkey, offset, offset + window - 1, 'WITHSCORES')
    if #items == 0 then return nil end
    for i = 1, #items, 2 do
      budget = budget - 1
      if not skip[prefix .. items[i]] then
        resume[zkey] = offset + (i - 1) / 2
        return items[i], tonumber(items[i + 1])
      end
    end
    offset = offset + window
    resume[zkey] = offset
  end
  return nil
end

local function pick_key(env, q, key_cap)
  local r = rkey(wg, env, q)
  while budget > 0 do
    local ck, kvt = first_free(r .. ':ks', skip_k, env .. '\0' .. q .. '\0')
    if not ck then return nil end
    if key_cap and key_running(env, q, ck) >= key_cap then
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
    local c = queue_seen(env, q)
    local tat = nil
    local allowed_at = nil
    if c.rate_t then
      tat = math.max(c.tat, now_us)
      allowed_at = tat - c.rate_tau
      -- `now` is a whole ms: a run due within it may go (one every 1,667 µs is 3 in 5 ms, and a
      -- rate over 1,000 a second is more than one a call, even without a burst)
      if allowed_at >= now_us + 1000 then tat = false end
    end
    -- (a limit of 0 holds every key: the queue is parked, not each of its keys one by one)
    if c.paused or (c.key_cap and c.key_cap <= 0) or (c.cap and c.running >= c.cap) then
      park_queue(wg, env, q)
    elseif tat == false then
      park_queue_until(wg, env, q, math.floor(allowed_at / 1000)) -- ahead of its rate (the ms it is due in)
    else
      local ck, kvt = pick_key(env, q, c.key_cap)
      if ck then return q, ck, kvt, tat and (tat + c.rate_t) end
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

-- After a run of key `ck` was popped and the key's and env's virtual times moved to kvt and evt:
-- refresh_key's work (queue_lib) without the reads whose answers this pass already has. The key
-- is still listed (its :ks entry was just updated), and neither it, its queue nor its env is
-- parked for this group (the pass chose them from the group's indexes).
local function after_pop(env, q, ck, r, kvt)
  local head = redis.call('ZRANGE', r .. ':k:' .. ck, 0, 0, 'WITHSCORES')
  if head[1] then
    redis.call('ZADD', r .. ':heads', head[2], ck)
  else
    redis.call('ZREM', r .. ':heads', ck)
    redis.call('ZREM', r .. ':ks', ck)
  end
  local qhead = redis.call('ZRANGE', r .. ':heads', 0, 0, 'WITHSCORES')
  if qhead[1] then
    -- the key went idle, others are still active: it keeps its time if ahead (save_key_time)
    if not head[1] and kvt > clocks[r .. ':vt'] then save_key_time(r, ck, kvt) end
    -- the env still has this ready queue and is listed: nothing to change at its level
    redis.call('ZADD', g .. ':e:' .. env .. ':qs', qhead[2], q)
  else
    forget_key_times(r) -- no key of the queue is active (:heads and :ks hold the same keys)
    redis.call('ZREM', g .. ':e:' .. env .. ':qs', q)
    refresh_env(wg, env)
  end
end

while #out < max * 7 and budget > 0 do
  local env, evt = pick_env()
  if not env then break end
  local e = env_seen(env)
  local q, ck, kvt, next_tat = nil, nil, nil, nil
  if e.running >= e.limit then
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
    if run then add_queued(env, q, -1) end
    refresh_key(wg, env, q, ck)
    resume = {}
    q = nil
  end
  if q then
    local deliveries = redis.call('HINCRBY', mk, 'deliveries', 1)
    redis.call('HSET', mk, 'state', 'held', 'held_at', now)
    local task = redis.call('HGET', mk, 'task') or ''
    redis.call('SADD', ekey(env) .. ':running', run)
    redis.call('SADD', qkey(env, q) .. ':running', run)
    redis.call('SADD', qkey(env, q) .. ':k:' .. ck .. ':running', run)
    local c = queues_seen[env .. '\0' .. q]
    e.running = e.running + 1
    if c.running then c.running = c.running + 1 end
    local kid = env .. '\0' .. q .. '\0' .. ck
    if keys_running[kid] then keys_running[kid] = keys_running[kid] + 1 end
    add_queued(env, q, -1)
    -- virtual times: the key and the env advance by one run; the clocks move to the served tag
    redis.call('ZADD', r .. ':ks', 'XX', kvt + 1, ck)
    if kvt > clock(r .. ':vt', function() return redis.call('GET', r .. ':vt') end) then
      redis.call('SET', r .. ':vt', kvt)
      clocks[r .. ':vt'] = kvt
    end
    redis.call('ZADD', g .. ':envs', 'XX', evt + 1, env)
    if evt > clock(g .. ':meta', function() return redis.call('HGET', g .. ':meta', 'vt') end) then
      redis.call('HSET', g .. ':meta', 'vt', evt)
      clocks[g .. ':meta'] = evt
    end
    if next_tat then
      -- (written as integers: a number's own text would round µs since 1970 to 14 digits)
      redis.call('HSET', qkey(env, q) .. ':meta', 'tat_us', string.format('%.0f', next_tat),
                 'tat', string.format('%.0f', math.floor(next_tat / 1000)))
      c.tat = next_tat
    end
    after_pop(env, q, ck, r, kvt + 1)
    for _, v in ipairs({run, env, q, ck, score, deliveries, task}) do out[#out + 1] = v end
  end
end
for _, c in pairs(queued) do count_queued(c[1], c[2], c[3]) end
local parked_until = redis.call('ZRANGE', g .. ':rp', 0, 0, 'WITHSCORES')
if parked_until[2] then rate_next = tonumber(parked_until[2]) end
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
