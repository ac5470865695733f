-- Append one op to a model's log: assign its seq, write the job, offer the model if unowned.
-- One atomic step, so a seq is never skipped or reused and a retried submit returns the
-- first job instead of running twice.
-- KEYS[1] model meta hash     KEYS[2] model ops stream    KEYS[3] idempotency key
-- KEYS[4] job hash (new id)   KEYS[5] model lease         KEYS[6] offers zset of the base
-- KEYS[7] pending set of base KEYS[8] records stream
-- ARGV[1] job id   ARGV[2] kind   ARGV[3] payload   ARGV[4] ttl seconds
-- ARGV[5] idempotency key ('' = none)   ARGV[6] model id
-- Returns {job id, 1 if newly queued else 0}; error 'UNKNOWN_MODEL' if the model is unknown.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('UNKNOWN_MODEL')
end
-- A client retrying a submit whose reply it lost sends the same job id: it finds its job.
if redis.call('EXISTS', KEYS[4]) == 1 then
  return {ARGV[1], 0}
end
local ttl = tonumber(ARGV[4])
if ARGV[5] ~= '' then
  local existing = redis.call('GET', KEYS[3])
  if existing then
    return {existing, 0}
  end
  redis.call('SET', KEYS[3], ARGV[1], 'EX', ttl)
  redis.call('HSET', KEYS[4], 'idempotency_key', ARGV[5])
end
append_op({KEYS[1], KEYS[2], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]},
  ARGV[1], ARGV[2], ARGV[3], ttl, ARGV[6])
return {ARGV[1], 1}
