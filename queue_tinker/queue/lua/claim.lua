-- Take ownership of a model if nobody holds it; the new epoch is the fencing token.
-- KEYS[1] model lease   KEYS[2] model epoch counter   KEYS[3] model meta   KEYS[4] offers zset
-- ARGV[1] worker id   ARGV[2] lease ttl (ms)   ARGV[3] model id
-- Returns {token, done_seq} or nil when another worker holds the lease.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return false
end
local epoch = redis.call('INCR', KEYS[2])
local token = ARGV[1] .. '|' .. epoch
redis.call('SET', KEYS[1], token, 'PX', ARGV[2])
redis.call('ZREM', KEYS[4], ARGV[3])
return {token, redis.call('HGET', KEYS[3], 'done_seq') or '0'}
