-- lock_release: delete lock keys, each only if it still holds its owner's token.
-- KEYS: lock keys; ARGV: the owner token of each key (same order)
-- returns: number of keys deleted
local n = 0
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[i] then n = n + redis.call('DEL', KEYS[i]) end
end
return n
