-- lock_extend: push back the expiry of held locks, each only if the token still owns it.
-- KEYS: lock keys; ARGV[1] ttl_ms, ARGV[2..] the owner token of each key (same order)
-- returns: array of 1 (extended) / 0 (lost), one per key
local out = {}
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[i + 1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[1])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
