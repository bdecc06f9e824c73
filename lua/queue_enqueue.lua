-- include: queue_lib
-- queue_enqueue: put runs into the queue (new or again: a known run is first detached, which
-- frees any slots it holds). Due runs become ready, others wait in their
-- environment's delayed set (B:e:<env>:delayed, indexed in B:delayed_envs).
-- KEYS[1] B:delayed (declares the shard's slot)
-- ARGV[1] B, ARGV[2] now ms, then per run 9 fields:
--   run, env, queue, ck, wg, score, due ms, task, reset_deliveries ('1' or '0')
-- returns: number of runs enqueued
local now = tonumber(ARGV[2])
local n = 0
-- A batch puts many runs into few keys: each key's indexes (its head, its queue's, its env's) are
-- refreshed once at the end, and the queued counters written once, not once per run. Nothing
-- here reads them in between, and a refresh reads only the key's state as it is at the end.
local dirty, queued, earliest = {}, {}, {}
for i = 3, #ARGV, 9 do
  local run = ARGV[i]
  local mk = B .. ':msg:' .. run
  local old = msg_fields(mk)
  if old then detach(run, old) end
  local m = {env = ARGV[i + 1], queue = ARGV[i + 2], ck = ARGV[i + 3], wg = ARGV[i + 4],
             score = tonumber(ARGV[i + 5]), task = ARGV[i + 7]}
  local due = tonumber(ARGV[i + 6])
  local state = due > now and 'delayed' or 'ready'
  if not old or ARGV[i + 8] == '1' then
    redis.call('HSET', mk, 'env', m.env, 'queue', m.queue, 'ck', m.ck, 'wg', m.wg, 'score', ARGV[i + 5],
               'task', m.task, 'state', state, 'due', due, 'deliveries', 0)
  else
    redis.call('HSET', mk, 'env', m.env, 'queue', m.queue, 'ck', m.ck, 'wg', m.wg, 'score', ARGV[i + 5],
               'task', m.task, 'state', state, 'due', due)
  end
  if old then redis.call('HDEL', mk, 'reason', 'dead_at') end
  if due > now then
    redis.call('ZADD', ekey(m.env) .. ':delayed', due, run)
    if not earliest[m.env] or due < earliest[m.env] then earliest[m.env] = due end
  else
    redis.call('ZADD', rkey(m.wg, m.env, m.queue) .. ':k:' .. m.ck, m.score, run)
    dirty[m.wg .. '\0' .. m.env .. '\0' .. m.queue .. '\0' .. m.ck] = m
  end
  local qid = m.env .. '\0' .. m.queue
  local c = queued[qid]
  if c then c[3] = c[3] + 1 else queued[qid] = {m.env, m.queue, 1} end
  n = n + 1
end
for _, m in pairs(dirty) do refresh_key(m.wg, m.env, m.queue, m.ck) end
for _, c in pairs(queued) do count_queued(c[1], c[2], c[3]) end
for env, due in pairs(earliest) do index_delayed(env, due) end
return n
