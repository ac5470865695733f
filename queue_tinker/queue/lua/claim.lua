-- Take ownership of a model if nobody holds it; the new epoch is the fencing token. A training
-- run whose tenant already has its limit of runs held elsewhere is not taken: it is parked,
-- paused with the reason, and offered again when one of the tenant's runs is released.
-- KEYS[1] model lease   KEYS[2] model epoch counter   KEYS[3] model meta   KEYS[4] offers zset
-- ARGV[1] worker id   ARGV[2] lease ttl (ms)   ARGV[3] model id   ARGV[4] key prefix
-- Returns {token, done_seq, tenant id}; {'', reason} when the tenant is at its limit; nil
-- when another worker holds the lease.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return false
end
local prefix, model_id = ARGV[4], ARGV[3]
local tenant = redis.call('HGET', KEYS[3], 'tenant_id') or ''
local leased = tenant_key(prefix, tenant, 'leased')
redis.call('ZREM', KEYS[4], model_id)
if redis.call('HGET', KEYS[3], 'kind') == 'training'
    and redis.call('SISMEMBER', leased, model_id) == 0 then
  local max_runs = tenant_limit(prefix, tenant, 'training_runs')
  if max_runs > 0 and leased_runs(prefix, tenant) >= max_runs then
    local reason = 'concurrent training clients rate limit hit (' .. max_runs ..
      ' training runs at once)'
    redis.call('HSET', KEYS[3], 'paused_reason', reason)
    redis.call('SADD', tenant_key(prefix, tenant, 'parked'), model_id)
    return {'', reason}
  end
end
local epoch = redis.call('INCR', KEYS[2])
local token = ARGV[1] .. '|' .. epoch
redis.call('SET', KEYS[1], token, 'PX', ARGV[2])
redis.call('SADD', leased, model_id)
redis.call('SREM', tenant_key(prefix, tenant, 'parked'), model_id)
redis.call('HDEL', KEYS[3], 'paused_reason')
return {token, redis.call('HGET', KEYS[3], 'done_seq') or '0', tenant}
