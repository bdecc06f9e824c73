-- include: queue_lib
-- queue_restore_dead: write again the DLQ entries of runs whose messages Redis lost (a flush, a
-- restart without persistence): the reconciler's rebuild, from the runs PostgreSQL shows in the
-- DLQ. Each entry goes to the DLQ of its own run's environment. A run the queue knows (its message
-- is there, in any state: redriven or enqueued again since, or still in the DLQ) is left as it is;
-- only a missing message is written, whole (as an enqueue writes it, so that a redrive puts it back
-- in its queue at its place) with state dlq, its time of death, reason and delivery count.
-- KEYS[1] B:delayed (declares the shard's slot)
-- ARGV[1] B, then per run 10 fields:
--   run, env, queue, ck, wg, score, task, dead at ms, reason, deliveries
-- returns: the number of entries written
local n = 0
for i = 2, #ARGV, 10 do
  local run = ARGV[i]
  local mk = B .. ':msg:' .. run
  if redis.call('EXISTS', mk) == 0 then
    local dead_at = ARGV[i + 7]
    redis.call('HSET', mk, 'env', ARGV[i + 1], 'queue', ARGV[i + 2], 'ck', ARGV[i + 3], 'wg', ARGV[i + 4],
               'score', ARGV[i + 5], 'task', ARGV[i + 6], 'state', 'dlq', 'due', dead_at,
               'deliveries', ARGV[i + 9], 'reason', ARGV[i + 8], 'dead_at', dead_at)
    redis.call('ZADD', ekey(ARGV[i + 1]) .. ':dlq', dead_at, run)
    n = n + 1
  end
end
return n
