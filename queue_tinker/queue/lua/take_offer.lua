-- Take the fairest offer of a base model: among the 64 oldest, the one whose tenant holds the
-- fewest leases (ties: the oldest), so a tenant flooding the queue with models does not keep
-- another tenant's model waiting behind them. A busy worker (ARGV[2] > 0) takes only offers
-- that waited that long (idle workers should get them first), or, after ARGV[3] ms, those of
-- a tenant with nothing leased at all.
-- KEYS[1] offers zset   ARGV[1] key prefix   ARGV[2] min age (ms)   ARGV[3] min age when the
-- tenant has nothing leased (ms)
-- Returns the model id, or nil.
local offers = redis.call('ZRANGE', KEYS[1], 0, 63, 'WITHSCORES')
local now = now_ms()
local best, best_load
for i = 1, #offers, 2 do
  local model_id, age = offers[i], now - tonumber(offers[i + 1])
  local tenant = redis.call('HGET', meta_key(ARGV[1], model_id), 'tenant_id') or ''
  local load = redis.call('SCARD', tenant_key(ARGV[1], tenant, 'leased'))
  local due = age >= tonumber(ARGV[2]) or (load == 0 and age >= tonumber(ARGV[3]))
  if due and (best == nil or load < best_load) then
    best, best_load = model_id, load
  end
end
if best == nil then
  return false
end
redis.call('ZREM', KEYS[1], best)
return best
