-- lock_acquire: try many lock requests at once; each request takes all its keys or none.
-- KEYS: the keys of every request, in request order
-- ARGV[1] ttl_ms, then per request: token, number of keys
-- returns: array of 1 (acquired) / 0 (some key held by another token), one per request
local ttl = ARGV[1]
local out = {}
local k = 1
for i = 2, #ARGV, 2 do
  local token, n = ARGV[i], tonumber(ARGV[i + 1])
  local free = true
  for j = k, k + n - 1 do
    local holder = redis.call('GET', KEYS[j])
    if holder and holder ~= token then free = false break end
  end
  if free then
    for j = k, k + n - 1 do redis.call('SET', KEYS[j], token, 'PX', ttl) end
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
  k = k + n
end
return out
