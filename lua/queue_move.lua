-- include: queue_lib
-- queue_move: the other single-run moves.
--   release      held -> released: free the slots, keep the message (a suspended run)
--   remove       anywhere -> gone (cancel, expire)
--   dead_letter  anywhere -> the environment's DLQ, with a reason
--   redrive      DLQ -> ready now, deliveries reset to 0
--   forget_dead  DLQ -> gone (its run was deleted, or left the DLQ another way); nothing elsewhere
--   giveback     held -> ready again at ARGV[5] (due ms), its slots freed and the delivery undone:
--                the worker that took it cannot run its task (a rolling deploy), another may
--   reclaim      ready or delayed -> held again, its slots taken (whatever the limits: the run is
--                handed out), only if the message is as the delivery ARGV[5] ('=<n>@<ms>', its
--                count and held_at) left it: a dequeue stalled between its take and its
--                PostgreSQL write past the reconciler's grace, which made the run ready again
--                (its slots freed, count and held_at kept), then wrote it; nobody took it since
-- KEYS[1] B:delayed
-- ARGV[1] B, ARGV[2] action, ARGV[3] run, ARGV[4] now ms, ARGV[5] reason (dead_letter), due ms
--   (giveback) or the delivery (reclaim)
-- returns: 1 when the run was there to move (for redrive: was in the DLQ), else 0
local action, run, now = ARGV[2], ARGV[3], tonumber(ARGV[4])
local mk = B .. ':msg:' .. run
local m = msg_fields(mk)
if not m then return 0 end
if action == 'release' then
  if m.state ~= 'held' then return 0 end
  free_slots(run, m)
  redis.call('HSET', mk, 'state', 'released')
elseif action == 'remove' then
  detach(run, m)
  redis.call('DEL', mk)
elseif action == 'forget_dead' then
  if m.state ~= 'dlq' then return 0 end
  detach(run, m)
  redis.call('DEL', mk)
elseif action == 'dead_letter' then
  detach(run, m)
  redis.call('HSET', mk, 'state', 'dlq', 'reason', ARGV[5], 'dead_at', now)
  redis.call('ZADD', ekey(m.env) .. ':dlq', now, run)
elseif action == 'redrive' then
  if m.state ~= 'dlq' then return 0 end
  detach(run, m)
  redis.call('HSET', mk, 'deliveries', 0)
  redis.call('HDEL', mk, 'reason', 'dead_at')
  attach(run, m, now, now)
elseif action == 'giveback' then
  if m.state ~= 'held' then return 0 end
  free_slots(run, m)
  if m.deliveries > 0 then redis.call('HINCRBY', mk, 'deliveries', -1) end
  attach(run, m, tonumber(ARGV[5]), now)
elseif action == 'reclaim' then
  if m.state ~= 'ready' and m.state ~= 'delayed' then return 0 end
  local count, at = string.match(ARGV[5], '^=(%d+)@(%d+)$')
  if not count or m.deliveries ~= tonumber(count)
      or tonumber(redis.call('HGET', mk, 'held_at') or '') ~= tonumber(at) then
    return 0
  end
  detach(run, m)
  redis.call('HSET', mk, 'state', 'held')
  redis.call('SADD', ekey(m.env) .. ':running', run)
  redis.call('SADD', qkey(m.env, m.queue) .. ':running', run)
  redis.call('SADD', qkey(m.env, m.queue) .. ':k:' .. m.ck .. ':running', run)
else
  return redis.error_reply('unknown action ' .. action)
end
return 1
