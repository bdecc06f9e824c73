-- include: queue_lib
-- queue_nack: a handed-out run was not started: free its slots and make it due again after a
-- back-off, or move it to its environment's DLQ once it was delivered `max_deliveries` times.
-- KEYS[1] B:delayed
-- ARGV[1] B, ARGV[2] run, ARGV[3] now ms, ARGV[4] max deliveries, ARGV[5] retry-at ms or '',
-- ARGV[6] min delay ms, ARGV[7] max delay ms, ARGV[8] factor, ARGV[9] random in [0, 1) for jitter
-- returns: {-1} unknown run | {1, deliveries, dead_at} dead-lettered | {0, deliveries, due}
local run, now = ARGV[2], tonumber(ARGV[3])
local mk = B .. ':msg:' .. run
local m = msg_fields(mk)
if not m then return {-1} end
detach(run, m)
if m.deliveries >= tonumber(ARGV[4]) then
  redis.call('HSET', mk, 'state', 'dlq', 'reason', 'max deliveries reached', 'dead_at', now)
  redis.call('ZADD', ekey(m.env) .. ':dlq', now, run)
  return {1, m.deliveries, now}
end
local due
if ARGV[5] ~= '' then
  due = tonumber(ARGV[5])
else
  local d = tonumber(ARGV[6]) * tonumber(ARGV[8]) ^ math.max(0, m.deliveries - 1)
  d = math.min(d * (1 + tonumber(ARGV[9])), tonumber(ARGV[7]))
  due = now + math.floor(d)
end
attach(run, m, due, now)
return {0, m.deliveries, due}
