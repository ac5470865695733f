-- Point a training run's inflight sampler weights at a newer save; an older save that
-- completes later never moves them back.
-- KEYS[1] the run's inflight hash
-- ARGV[1] the save's seq   ARGV[2] its tinker:// path   ARGV[3] TTL in seconds
-- Returns the seq the weights are at afterwards.
local current = tonumber(redis.call('HGET', KEYS[1], 'seq') or '0')
local seq = tonumber(ARGV[1])
if seq > current then
  redis.call('HSET', KEYS[1], 'seq', seq, 'path', ARGV[2])
  current = seq
end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
return current
