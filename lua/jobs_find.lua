-- include: jobs_lib
-- jobs_find: per job, the run-at ms (a claimed one's: its lease's end; false: not scheduled) and
-- the lane it is in ('': the default one).
-- KEYS[1] J:items
-- ARGV[1] J, then ids
-- returns: flat array score1, lane1, score2, lane2, ...
local out = {}
for i = 2, #ARGV do
  local lane = lane_of(ARGV[i])
  local score = redis.call('ZSCORE', lane_key(lane), ARGV[i])
  if score and redis.call('HEXISTS', ITEMS, ARGV[i]) == 1 then out[#out + 1] = score else out[#out + 1] = false end
  out[#out + 1] = lane
end
return out
