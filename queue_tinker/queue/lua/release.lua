-- Give a model up. Without force, refuse if ops arrived that are not yet published (the owner
-- will see them); with force, release anyway and offer the model to other workers. A released
-- training run frees a slot of its tenant's limit: the runs parked for it are offered again.
-- KEYS[1] model lease   KEYS[2] model meta   KEYS[3] offers zset   KEYS[4] pending set
-- ARGV[1] token   ARGV[2] model id   ARGV[3] force ('1' or '0')   ARGV[4] key prefix
-- Returns 1 released, 0 kept (pending ops), -1 the lease was not ours.
if not holds_lease(KEYS[1], ARGV[1]) then
  return -1
end
local last = tonumber(redis.call('HGET', KEYS[2], 'last_seq') or '0')
local done = tonumber(redis.call('HGET', KEYS[2], 'done_seq') or '0')
if last > done and ARGV[3] ~= '1' then
  return 0
end
redis.call('DEL', KEYS[1])
local prefix = ARGV[4]
local tenant = redis.call('HGET', KEYS[2], 'tenant_id') or ''
redis.call('SREM', tenant_key(prefix, tenant, 'leased'), ARGV[2])
if last > done then
  offer(KEYS[3], ARGV[2])
end
local parked = tenant_key(prefix, tenant, 'parked')
for _, model_id in ipairs(redis.call('SMEMBERS', parked)) do
  local base = redis.call('HGET', meta_key(prefix, model_id), 'base_model')
  if base and redis.call('EXISTS', lease_key(prefix, model_id)) == 0 then
    offer(offers_key(prefix, base), model_id)
  end
end
redis.call('DEL', parked)
return 1
