-- include: queue_lib
-- queue_enqueue: put runs into the queue (new or again: a known run is first detached, which
-- frees any slots it holds). Due runs become ready, others wait in B:delayed.
-- KEYS[1] B:delayed (declares the shard's slot)
-- ARGV[1] B, ARGV[2] now ms, then per run 9 fields:
--   run, env, queue, ck, wg, score, due ms, task, reset_deliveries ('1' or '0')
-- returns: number of runs enqueued
local now = tonumber(ARGV[2])
local n = 0
for i = 3, #ARGV, 9 do
  local run = ARGV[i]
  local mk = B .. ':msg:' .. run
  local old = msg_fields(mk)
  if old then detach(run, old) end
  local m = {env = ARGV[i + 1], queue = ARGV[i + 2], ck = ARGV[i + 3], wg = ARGV[i + 4],
             score = tonumber(ARGV[i + 5]), task = ARGV[i + 7]}
  redis.call('HSET', mk, 'env', m.env, 'queue', m.queue, 'ck', m.ck, 'wg', m.wg,
             'score', ARGV[i + 5], 'task', m.task)
  if not old or ARGV[i + 8] == '1' then redis.call('HSET', mk, 'deliveries', 0) end
  redis.call('HDEL', mk, 'reason', 'dead_at')
  attach(run, m, tonumber(ARGV[i + 6]), now)
  n = n + 1
end
return n
