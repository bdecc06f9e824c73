-- queue_lib: helpers shared by the queue_*.lua scripts (put in front of each by `-- include:`).
-- Every key lives under one shard base B = '<prefix>:{rq:N}' (a hash tag: one cluster slot).
-- Layout (see docs/ARCHITECTURE.md, "Run queue"):
--   B:msg:<run>                       HASH  env, queue, ck, wg, score, due, deliveries, task, state, reason, dead_at
--   B:delayed                         ZSET  run -> due ms: runs the version before this one delayed (a
--                                           rolling upgrade); promoted, never written
--   B:delayed_envs                    ZSET  env -> due ms of the earliest run in its :delayed (or
--                                           earlier: a run taken out of it leaves the score; or, while
--                                           some are due, the time of the promotion that last served it)
--   B:g:<wg>:envs                     ZSET  env -> virtual time (envs of group wg with ready runs)
--   B:g:<wg>:meta / :evt              HASH  vt (group virtual clock) / env -> saved virtual time
--   B:g:<wg>:e:<env>:qs               ZSET  queue -> head score (queues with ready runs)
--   B:g:<wg>:e:<env>:q:<q>:k:<ck>     ZSET  run -> score (ready runs of one concurrency key)
--   B:g:<wg>:e:<env>:q:<q>:ks         ZSET  ck -> virtual time (keys with ready runs)
--   B:g:<wg>:e:<env>:q:<q>:heads      ZSET  ck -> head score
--   B:g:<wg>:e:<env>:q:<q>:kvz        ZSET  ck -> saved virtual time of an idle key (see save_key_time)
--   B:g:<wg>:e:<env>:q:<q>:vt         STRING queue virtual clock
--   B:e:<env>:meta                    HASH  limit, queued
--   B:e:<env>:running                 SET   runs holding an env slot
--   B:e:<env>:q:<q>:meta              HASH  limit (each key's), key_limit, cap (all keys'), paused, queued,
--                                           the rate limit's rate_t, rate_tau, tat (ms) and rate_t_us,
--                                           rate_tau_us, rate_us_for, tat_us (see rate_us_holds)
--   B:e:<env>:q:<q>:running           SET   runs holding a queue slot
--   B:e:<env>:q:<q>:k:<ck>:running    SET   runs holding a key slot
--   B:e:<env>:delayed                 ZSET  run -> due ms (not yet visible: delays, retry back-offs)
--   B:e:<env>:dlq                     ZSET  run -> dead at ms
--   B:e:<env>:parked                  SET   groups in whose index the env is parked (at its limit)
--   B:e:<env>:q:<q>:parked            SET   groups in whose index the queue is parked (paused / at its cap / limit 0)
--   B:e:<env>:q:<q>:k:<ck>:parked     SET   groups in whose index the key is parked (at its limit)
--   B:e:<env>:q:<q>:pk                SET   keys of the queue with a :parked set (but those in :upk)
--   B:e:<env>:q:<q>:upk               SET   keys parked before a raise, still to put back (unpark_keys)
--   B:unpark                          SET   env NUL queue: queues whose :upk holds keys
--   B:g:<wg>:rp                       ZSET  env NUL queue -> ms: queues parked while ahead of their rate
-- Message states: ready, delayed, held (holds slots), released (suspended), dlq.
-- Parking: the dequeue takes an env, queue or key it finds blocked out of the group's indexes
-- (its ready runs stay where they are), so blocked tenants cost nothing to later calls. A freed
-- slot at that level, a limit change or a resume puts it back (unpark_*), with fair-queuing
-- virtual time max(its own, the clock): it neither jumps ahead nor loses its place.

local B = ARGV[1]

local function ekey(env) return B .. ':e:' .. env end
local function qkey(env, q) return B .. ':e:' .. env .. ':q:' .. q end
local function gkey(wg) return B .. ':g:' .. wg end
local function rkey(wg, env, q) return B .. ':g:' .. wg .. ':e:' .. env .. ':q:' .. q end

local function msg_fields(mk)
  local raw = redis.call('HMGET', mk, 'env', 'queue', 'ck', 'wg', 'score', 'state', 'deliveries', 'task', 'due')
  if not raw[1] then return nil end
  return {env = raw[1], queue = raw[2], ck = raw[3] or '', wg = raw[4], score = tonumber(raw[5]),
          state = raw[6], deliveries = tonumber(raw[7] or '0'), task = raw[8] or '', due = raw[9]}
end

local function count_queued(env, q, delta)
  redis.call('HINCRBY', qkey(env, q) .. ':meta', 'queued', delta)
  redis.call('HINCRBY', ekey(env) .. ':meta', 'queued', delta)
end

-- An env is listed for its group while any of its queues has ready runs.
local function refresh_env(wg, env)
  local g = gkey(wg)
  local active = redis.call('EXISTS', g .. ':e:' .. env .. ':qs') == 1
    and redis.call('SISMEMBER', ekey(env) .. ':parked', wg) == 0
  local cur = redis.call('ZSCORE', g .. ':envs', env)
  if active and not cur then
    local gvt = tonumber(redis.call('HGET', g .. ':meta', 'vt') or '0')
    local evt = tonumber(redis.call('HGET', g .. ':evt', env) or '0')
    redis.call('ZADD', g .. ':envs', math.max(gvt, evt), env)
    redis.call('HDEL', g .. ':evt', env)
  elseif cur and not active then
    local gvt = tonumber(redis.call('HGET', g .. ':meta', 'vt') or '0')
    if tonumber(cur) > gvt then redis.call('HSET', g .. ':evt', env, cur) end
    redis.call('ZREM', g .. ':envs', env)
  end
end

-- A queue is listed in its env with the score of its oldest ready run.
local function refresh_queue(wg, env, q)
  local r = rkey(wg, env, q)
  local head = redis.call('ZRANGE', r .. ':heads', 0, 0, 'WITHSCORES')
  local qs = gkey(wg) .. ':e:' .. env .. ':qs'
  if head[1] and redis.call('SISMEMBER', qkey(env, q) .. ':parked', wg) == 0 then
    redis.call('ZADD', qs, head[2], q)
  else
    redis.call('ZREM', qs, q)
  end
  refresh_env(wg, env)
end

-- A key that goes idle while its virtual time is ahead of its queue's clock keeps that time in
-- the queue's :kvz, so that coming back at once it does not jump ahead of the keys it was served
-- before (it starts at max(the clock, its time)). Such a time is at most one run ahead of the
-- clock: once the clock reaches it, it is worth nothing. So a queue none of whose keys is active
-- any more (in this group) forgets them all (forget_key_times: a key coming back starts at the
-- clock, as a new one: the end of a busy period of start-time fair queuing), and a queue that is
-- never idle keeps the KEY_TIMES_MAX highest (a key dropped comes back at the clock: one turn
-- early at most, among its own queue's keys). Each distinct key (a request id, a user id) left one
-- entry for ever, removed only if that key was used again.
local KEY_TIMES_MAX = 1000

local function save_key_time(r, ck, vt)
  local kz = r .. ':kvz'
  redis.call('ZADD', kz, vt, ck)
  local n = redis.call('ZCARD', kz)
  if n > KEY_TIMES_MAX then redis.call('ZREMRANGEBYRANK', kz, 0, n - KEY_TIMES_MAX - 1) end
end

-- (:kvt is the HASH of the version before, which kept every idle key's time for ever: dropped too)
local function forget_key_times(r)
  redis.call('UNLINK', r .. ':kvz', r .. ':kvt')
end

-- After a key's ready set changed: keep its head score, (de)activate it with its virtual time.
local function refresh_key(wg, env, q, ck)
  local r = rkey(wg, env, q)
  local kz = r .. ':k:' .. ck
  local head = redis.call('ZRANGE', kz, 0, 0, 'WITHSCORES')
  local cur = redis.call('ZSCORE', r .. ':ks', ck)
  if head[1] and redis.call('SISMEMBER', qkey(env, q) .. ':k:' .. ck .. ':parked', wg) == 0 then
    redis.call('ZADD', r .. ':heads', head[2], ck)
    if not cur then
      local qvt = tonumber(redis.call('GET', r .. ':vt') or '0')
      local kvt = redis.call('ZSCORE', r .. ':kvz', ck)
      redis.call('ZADD', r .. ':ks', math.max(qvt, tonumber(kvt or '0')), ck)
      if kvt then redis.call('ZREM', r .. ':kvz', ck) end
    end
  else
    redis.call('ZREM', r .. ':heads', ck)
    if cur then
      redis.call('ZREM', r .. ':ks', ck)
      if redis.call('EXISTS', r .. ':ks') == 0 then
        forget_key_times(r)
      elseif tonumber(cur) > tonumber(redis.call('GET', r .. ':vt') or '0') then
        save_key_time(r, ck, cur)
      end
    end
  end
  refresh_queue(wg, env, q)
end

local function make_ready(run, m)
  redis.call('ZADD', rkey(m.wg, m.env, m.queue) .. ':k:' .. m.ck, m.score, run)
  refresh_key(m.wg, m.env, m.queue, m.ck)
end

-- Parking (see the header): `park_*` take a blocked entry out of group wg's index,
-- `unpark_*` put it back in every group where it was parked.
local function park_env(wg, env)
  redis.call('SADD', ekey(env) .. ':parked', wg)
  refresh_env(wg, env)
end

local function park_queue(wg, env, q)
  redis.call('SADD', qkey(env, q) .. ':parked', wg)
  refresh_queue(wg, env, q)
end

-- A queue ahead of its rate limit is parked until `at` (a time, not a slot, frees it): listed in
-- the group's :rp, from which the group's next dequeue at or after `at` unparks it (unpark_rated).
local function park_queue_until(wg, env, q, at)
  redis.call('ZADD', gkey(wg) .. ':rp', at, env .. '\0' .. q)
  park_queue(wg, env, q)
end

local function park_key(wg, env, q, ck)
  redis.call('SADD', qkey(env, q) .. ':k:' .. ck .. ':parked', wg)
  redis.call('SADD', qkey(env, q) .. ':pk', ck)
  refresh_key(wg, env, q, ck)
end

local function unpark_env(env)
  local pk = ekey(env) .. ':parked'
  local wgs = redis.call('SMEMBERS', pk)
  if #wgs == 0 then return end
  redis.call('DEL', pk)
  for _, wg in ipairs(wgs) do refresh_env(wg, env) end
end

local function unpark_queue(env, q)
  local pk = qkey(env, q) .. ':parked'
  local wgs = redis.call('SMEMBERS', pk)
  if #wgs == 0 then return end
  redis.call('DEL', pk)
  for _, wg in ipairs(wgs) do refresh_queue(wg, env, q) end
end

local function unpark_key(env, q, ck)
  local pk = qkey(env, q) .. ':k:' .. ck .. ':parked'
  local wgs = redis.call('SMEMBERS', pk)
  if #wgs == 0 then return end
  redis.call('DEL', pk)
  redis.call('SREM', qkey(env, q) .. ':pk', ck)
  for _, wg in ipairs(wgs) do refresh_key(wg, env, q, ck) end
end

-- The queues of group wg parked for their rate whose time has come are listed again (bounded per
-- call; a queue unparked meanwhile by a freed slot or a change of its settings is listed already).
local function unpark_rated(wg, now, limit)
  local rp = gkey(wg) .. ':rp'
  local due = redis.call('ZRANGEBYSCORE', rp, '-inf', now, 'LIMIT', 0, limit)
  for _, member in ipairs(due) do
    redis.call('ZREM', rp, member)
    local cut = string.find(member, '\0', 1, true)
    if cut then
      local env, q = string.sub(member, 1, cut - 1), string.sub(member, cut + 1)
      if redis.call('SREM', qkey(env, q) .. ':parked', wg) == 1 then refresh_queue(wg, env, q) end
    end
  end
end

-- A queue's rate limit is kept in µs (rate_t_us, rate_tau_us, tat_us) beside the same in whole ms
-- (rate_t, rate_tau, tat) that the version before reads and writes. That version (a rolling
-- upgrade) writes and deletes only the fields in ms, so the µs fields hold only while the ms fields
-- still say what was written beside them: the rate's while `rate_us_for` is "rate_t,rate_tau" (that
-- version removed the rate, or set another, otherwise), the arrival time's while `tat` is `tat_us`
-- in whole ms (that version's config deleted `tat` for a new rate, or its dequeue moved it, otherwise).
local function rate_us_holds(t, tau, us_for)
  return t and us_for and us_for == t .. ',' .. (tau or '') or false
end

local function tat_us_holds(tat, tat_us)
  return tat and tat_us and tonumber(tat) == math.floor(tonumber(tat_us) / 1000) or false
end

-- A queue's parked keys are put back at most `limit` at a time (each a few commands): a raise of
-- the limit of a queue with 100,000 keys parked was one call of seconds, Redis serving no one else
-- meanwhile. A raise moves the keys parked so far (:pk) to the queue's :upk, the keys it is still
-- putting back, and lists the queue in B:unpark (env NUL queue) while :upk holds any: the shard's
-- next dequeue calls go on with them (unpark_pending). Keys parked after the raise (at the new
-- limit, still blocked) go to :pk again, not :upk: listed with the keys to put back, they were put
-- back by every dequeue call of the shard and parked again by it, and with over 500 of them the
-- queue never left B:unpark (each call of every group paid for 500 for as long as they had runs
-- waiting). A key in :upk that a freed slot put back meanwhile is only dropped from it.
local function unpark_listed(env, q, limit)
  local upk = qkey(env, q) .. ':upk'
  local done = 0
  while done < limit do
    local some = redis.call('SRANDMEMBER', upk, math.min(limit - done, 200))
    if #some == 0 then break end
    for _, ck in ipairs(some) do
      unpark_key(env, q, ck)
      redis.call('SREM', upk, ck)
    end
    done = done + #some
  end
  if redis.call('EXISTS', upk) == 1 then
    redis.call('SADD', B .. ':unpark', env .. '\0' .. q)
  else
    redis.call('SREM', B .. ':unpark', env .. '\0' .. q)
  end
  return done
end

-- The keys parked so far join the ones to put back (a raise; O(1) but for a raise while some of an
-- earlier one's are still there: O(both), in Redis's own code).
local function take_parked(env, q)
  local pk, upk = qkey(env, q) .. ':pk', qkey(env, q) .. ':upk'
  if redis.call('EXISTS', pk) == 0 then return end
  if redis.call('EXISTS', upk) == 0 then
    redis.call('RENAME', pk, upk)
  else
    redis.call('SUNIONSTORE', upk, upk, pk)
    redis.call('DEL', pk)
  end
end

-- A raise: put back the keys parked at the old limit, `limit` now and the rest later. Returns how
-- many were put back now.
local function unpark_keys(env, q, limit)
  take_parked(env, q)
  return unpark_listed(env, q, limit)
end

-- Go on putting back the keys of the queues listed in B:unpark, at most `limit` keys a call.
local function unpark_pending(limit)
  local left = limit
  while left > 0 do
    local member = redis.call('SRANDMEMBER', B .. ':unpark')
    if not member then return end
    local cut = string.find(member, '\0', 1, true)
    if not cut then
      redis.call('SREM', B .. ':unpark', member)
    else
      local env, q = string.sub(member, 1, cut - 1), string.sub(member, cut + 1)
      -- (listed by the version before this one, which put back the keys of :pk: they are taken once)
      if redis.call('EXISTS', qkey(env, q) .. ':upk') == 0 then take_parked(env, q) end
      left = left - unpark_listed(env, q, left)
    end
  end
end

-- A held run gives its slots back; whatever was parked at those levels may run again.
local function free_slots(run, m)
  redis.call('SREM', ekey(m.env) .. ':running', run)
  redis.call('SREM', qkey(m.env, m.queue) .. ':running', run)
  redis.call('SREM', qkey(m.env, m.queue) .. ':k:' .. m.ck .. ':running', run)
  unpark_key(m.env, m.queue, m.ck)
  unpark_queue(m.env, m.queue)
  unpark_env(m.env)
end

-- The environment's earliest due time in the shard's index of delayed environments: at most `due`.
local function index_delayed(env, due)
  local cur = redis.call('ZSCORE', B .. ':delayed_envs', env)
  if not cur or due < tonumber(cur) then redis.call('ZADD', B .. ':delayed_envs', due, env) end
end

-- A run waits in its own environment's delayed set, not yet visible, until `due`.
local function delay(run, env, due)
  redis.call('ZADD', ekey(env) .. ':delayed', due, run)
  index_delayed(env, due)
end

-- Take a message out of wherever it is (ready, delayed, held, dlq); the hash stays.
local function detach(run, m)
  local s = m.state
  if s == 'ready' then
    redis.call('ZREM', rkey(m.wg, m.env, m.queue) .. ':k:' .. m.ck, run)
    refresh_key(m.wg, m.env, m.queue, m.ck)
    count_queued(m.env, m.queue, -1)
  elseif s == 'delayed' then
    local dk = ekey(m.env) .. ':delayed'
    if redis.call('ZREM', dk, run) == 1 and redis.call('EXISTS', dk) == 0 then
      redis.call('ZREM', B .. ':delayed_envs', m.env)
    end
    -- and out of the shard's set, always: in a rolling upgrade a run may be in both (delayed here,
    -- then again by the version before, which leaves this entry), and the version before promotes
    -- whatever that set holds, whatever its message says (a held run handed out twice, a run
    -- delayed again made ready before its time)
    redis.call('ZREM', B .. ':delayed', run)
    count_queued(m.env, m.queue, -1)
  elseif s == 'held' then
    free_slots(run, m)
  elseif s == 'dlq' then
    redis.call('ZREM', ekey(m.env) .. ':dlq', run)
  end
end

-- Put a detached message in the queue: ready if due, else delayed until `due`.
local function attach(run, m, due, now)
  local mk = B .. ':msg:' .. run
  if due > now then
    delay(run, m.env, due)
    redis.call('HSET', mk, 'state', 'delayed', 'due', due)
  else
    redis.call('HSET', mk, 'state', 'ready', 'due', due)
    make_ready(run, m)
  end
  count_queued(m.env, m.queue, 1)
end

-- A delayed run taken out of its set at `now` becomes ready, only if its message still says it is
-- delayed until then: an entry a process of the version before left behind when it moved the run
-- on (it takes runs out of the shard's one set only), or delayed it again, is dropped.
local function make_due(run, now)
  local mk = B .. ':msg:' .. run
  local m = msg_fields(mk)
  if m and m.state == 'delayed' and (tonumber(m.due) or 0) <= now then
    redis.call('ZREM', B .. ':delayed', run) -- (see detach) its entry there, if any, is stale now
    redis.call('HSET', mk, 'state', 'ready')
    make_ready(run, m)
  end
end

-- Delayed runs whose time has come become ready, at most `limit` a call, shared evenly among the
-- environments that have some due, earliest first: one tenant's flood of retries due at once is
-- promoted a share at a time beside everyone else's, never ahead of them (its runs then compete
-- for the dequeue fairly, like any ready run).
local function promote(now, limit)
  local n = 0
  -- runs the version before this one delayed, in the shard's one set (a rolling upgrade)
  local old = redis.call('ZRANGEBYSCORE', B .. ':delayed', '-inf', now, 'LIMIT', 0, limit)
  for _, run in ipairs(old) do
    redis.call('ZREM', B .. ':delayed', run)
    make_due(run, now)
  end
  n = n + #old
  local envs = redis.call('ZRANGEBYSCORE', B .. ':delayed_envs', '-inf', now, 'LIMIT', 0, limit)
  if #envs == 0 then return n end
  local share = math.max(1, math.floor(limit / #envs))
  for _, env in ipairs(envs) do
    local dk = ekey(env) .. ':delayed'
    local due = redis.call('ZRANGEBYSCORE', dk, '-inf', now, 'LIMIT', 0, share)
    for _, run in ipairs(due) do
      redis.call('ZREM', dk, run)
      make_due(run, now)
    end
    n = n + #due
    local head = redis.call('ZRANGE', dk, 0, 0, 'WITHSCORES')
    if head[1] then
      -- some still due: indexed at `now`, behind the environments due that this call left out
      -- (more than `limit`), which come first in the next; at its head, the earliest due ones
      -- came first again and again, and an environment due later waited for all of them
      redis.call('ZADD', B .. ':delayed_envs', math.max(tonumber(head[2]), now), env)
    else
      redis.call('ZREM', B .. ':delayed_envs', env)
    end
  end
  return n
end
