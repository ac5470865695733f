-- Give a model up. Without force, refuse if ops arrived that are not yet published (the owner
-- will see them); with force, release anyway and offer the model to other workers.
-- KEYS[1] model lease   KEYS[2] model meta   KEYS[3] offers zset   KEYS[4] pending set
-- ARGV[1] token   ARGV[2] model id   ARGV[3] force ('1' or '0')
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
if last > done then
  redis.call('ZADD', KEYS[3], 'NX', now_ms(), ARGV[2])
end
return 1
