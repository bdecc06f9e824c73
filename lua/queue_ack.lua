-- include: queue_lib
-- queue_ack: runs are done with the queue: free their slots and delete their messages.
-- KEYS[1] B:delayed
-- ARGV[1] B, then per run 2 fields: run id, held_only ('1': only a message still held by the
--   dequeue that handed the run out; a run suspended while a continuation enqueued it again
--   keeps that new message. '=<n>@<ms>': only a message still held by the delivery that took it
--   as its n-th at <ms> (held_at: a dequeue dropping what it took: the run may have been made
--   ready again and handed out since, and that delivery's slot is another's; the count alone does
--   not tell them apart, as a retry, a continuation and a redrive reset it). '=<n>': the count
--   only. '0': wherever the message is)
-- returns: number of messages deleted (unknown runs are ignored)
-- A held run's slots are freed at once; what they unpark (its key, queue and env, parked while at a
-- limit) is unparked once per key, queue and env at the end, not once per run: a batch of acks
-- frees many slots of few keys.
local n = 0
local freed_keys, freed_queues, freed_envs = {}, {}, {}
for i = 2, #ARGV, 2 do
  local run = ARGV[i]
  local mk = B .. ':msg:' .. run
  local m = msg_fields(mk)
  local only = ARGV[i + 1]
  local ok = m and (only == '0' or (m.state == 'held' and only == '1'))
  if m and not ok and m.state == 'held' and string.sub(only, 1, 1) == '=' then
    local count, at = string.match(only, '^=(%d+)@?(%d*)$')
    ok = count ~= nil and m.deliveries == tonumber(count)
      and (at == '' or tonumber(redis.call('HGET', mk, 'held_at') or '') == tonumber(at))
  end
  if ok then
    if m.state == 'held' then
      redis.call('SREM', ekey(m.env) .. ':running', run)
      redis.call('SREM', qkey(m.env, m.queue) .. ':running', run)
      redis.call('SREM', qkey(m.env, m.queue) .. ':k:' .. m.ck .. ':running', run)
      freed_keys[m.env .. '\0' .. m.queue .. '\0' .. m.ck] = m
      freed_queues[m.env .. '\0' .. m.queue] = m
      freed_envs[m.env] = m
    else
      detach(run, m)
    end
    redis.call('DEL', mk)
    n = n + 1
  end
end
-- in free_slots' order: keys, then queues, then environments
for _, m in pairs(freed_keys) do unpark_key(m.env, m.queue, m.ck) end
for _, m in pairs(freed_queues) do unpark_queue(m.env, m.queue) end
for _, m in pairs(freed_envs) do unpark_env(m.env) end
return n
