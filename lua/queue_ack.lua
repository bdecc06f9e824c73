-- include: queue_lib
-- queue_ack: runs are done with the queue: free their slots and delete their messages.
-- KEYS[1] B:delayed
-- ARGV[1] B, then per run 2 fields: run id, held_only ('1': only a message still held by the
--   dequeue that handed the run out; a run suspended while a continuation enqueued it again
--   keeps that new message. '0': wherever the message is)
-- returns: number of messages deleted (unknown runs are ignored)
local n = 0
for i = 2, #ARGV, 2 do
  local mk = B .. ':msg:' .. ARGV[i]
  local m = msg_fields(mk)
  if m and (ARGV[i + 1] ~= '1' or m.state == 'held') then
    detach(ARGV[i], m)
    redis.call('DEL', mk)
    n = n + 1
  end
end
return n
