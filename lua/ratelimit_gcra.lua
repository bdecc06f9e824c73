-- ratelimit_gcra: the API's request rate limit per credential (GCRA, as the queue's rate limit):
-- each bucket holds its theoretical arrival time (TAT). Taking n requests' worth is allowed when
-- TAT + (n - 1) * t - tau <= now, and then TAT advances by n * t. A server process takes a grant
-- of several at once and spends them locally (fewer round trips); when a grant of n does not fit,
-- one is tried. Requests of one call are decided in order (a bucket may appear more than once).
-- KEYS: one bucket key per request, all under the {rl} hash tag (one cluster slot)
-- ARGV[1] now ms, ARGV[2] emission interval t ms (1000 / rate), ARGV[3] burst tolerance tau ms,
-- ARGV[3 + i] the grant wanted for KEYS[i]
-- returns: per request, the number granted (> 0), or minus the ms until one would be (< 0)
local now, t, tau = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local out = {}
for i = 1, #KEYS do
  local tat = math.max(tonumber(redis.call('GET', KEYS[i]) or '0'), now)
  local n = tonumber(ARGV[3 + i])
  if n > 1 and tat + (n - 1) * t - tau > now then n = 1 end
  local allowed_at = tat + (n - 1) * t - tau
  if allowed_at <= now then
    redis.call('SET', KEYS[i], tat + n * t, 'PX', math.ceil(tau + n * t) + 1000)
    out[i] = n
  else
    out[i] = -math.ceil(allowed_at - now)
  end
end
return out
