-- include: jobs_lib
-- jobs_find: the run-at ms of each job (a claimed one's: its lease's end), false for one not scheduled.
-- KEYS[1] J:items
-- ARGV[1] J, then ids
local out = {}
for i = 2, #ARGV do
  local score = redis.call('ZSCORE', lane_key(lane_of(ARGV[i])), ARGV[i])
  if score and redis.call('HEXISTS', ITEMS, ARGV[i]) == 1 then out[#out + 1] = score else out[#out + 1] = false end
end
return out
