-- include: jobs_lib
-- jobs_dlq: act on entries of the job DLQ (J:dlq  HASH id -> the dead job's JSON, with its error and
-- dead_at ms), each only while it is still the entry the caller read: one written again meanwhile (the
-- job armed again and dead again) is left for the caller to read again.
-- KEYS[1] J:items
-- ARGV[1] J, ARGV[2] now ms, then per entry 5 fields: id, action, the entry as read (with 'forget':
--   ignored), new JSON, lane ('': the default one)
--   'retry'  the job (new JSON: attempt 0, a new token) is scheduled in its lane to run now and its entry
--            leaves the DLQ; should a job of that id be scheduled already (armed again by a process
--            that left its dead copy), that job is left as it is and the copy is dropped
--   'drop'   the entry is deleted;  'forget': whatever it is
--   'stamp'  the entry is replaced by the new JSON (retention's time of first sight of an entry that
--            carries no dead_at)
-- returns per entry: 1 done, 0 no such entry or another one now, 2 ('retry') a job of that id was
-- scheduled already (its dead copy dropped)
local DLQ = J .. ':dlq'
local now = tonumber(ARGV[2])
local out = {}
for i = 3, #ARGV, 5 do
  local id, action, expected, new, lane = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  local entry = redis.call('HGET', DLQ, id)
  if not entry or (action ~= 'forget' and entry ~= expected) then
    out[#out + 1] = 0
  elseif action == 'drop' or action == 'forget' then
    redis.call('HDEL', DLQ, id)
    out[#out + 1] = 1
  elseif action == 'stamp' then
    redis.call('HSET', DLQ, id, new)
    out[#out + 1] = 1
  elseif redis.call('HEXISTS', ITEMS, id) == 1 then  -- retry of a job scheduled already
    redis.call('HDEL', DLQ, id)
    out[#out + 1] = 2
  else  -- retry
    place(id, lane, now, now)
    redis.call('HSET', ITEMS, id, new)
    redis.call('HDEL', DLQ, id)
    out[#out + 1] = 1
  end
end
return out
