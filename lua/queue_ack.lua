-- include: queue_lib
-- queue_ack: runs are done with the queue: free their slots and delete their messages.
-- KEYS[1] B:delayed
-- ARGV[1] B, ARGV[2..] run ids
-- returns: number of messages deleted (unknown runs are ignored)
local n = 0
for i = 2, #ARGV do
  local mk = B .. ':msg:' .. ARGV[i]
  local m = msg_fields(mk)
  if m then
    detach(ARGV[i], m)
    redis.call('DEL', mk)
    n = n + 1
  end
end
return n
