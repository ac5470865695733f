-- Extend every lease this worker still holds, in one round trip.
-- KEYS[i] lease of model i   ARGV[1] ttl (ms)   ARGV[i + 1] the token held for model i
-- Returns a list of 1 (renewed) or 0 (lost: another worker owns it or it lapsed).
local out = {}
for i = 1, #KEYS do
  if holds_lease(KEYS[i], ARGV[i + 1]) then
    redis.call('PEXPIRE', KEYS[i], ARGV[1])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
