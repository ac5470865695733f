-- Publish a job's outcome, fenced by the lease: job hash, model progress, the tenant's limits,
-- counters, record, wake-up.
-- KEYS[1] model lease   KEYS[2] job hash   KEYS[3] model meta   KEYS[4] model ops stream
-- KEYS[5] pending set of base   KEYS[6] records stream   KEYS[7] model events channel
-- ARGV[1] token   ARGV[2] status ('done'/'failed')   ARGV[3] result bytes   ARGV[4] error
-- ARGV[5] error category   ARGV[6] metrics (JSON, '' none)   ARGV[7] seq   ARGV[8] ttl seconds
-- ARGV[9] model id   ARGV[10] trim the log up to this seq ('' = keep)   ARGV[11] error detail
-- ARGV[12] worker id, when the op ran without start.lua (an inline op): start it here too
-- ARGV[13] tokens the op processed   ARGV[14] key prefix
-- ARGV[15] (optional) records the op made, for the records stream: msgpack of a list of flat
-- {field, value, ...} lists ('' or absent: none); written only under the lease, as the rest
-- ARGV[16] (optional) '1': do not PUBLISH the wake-up; return it instead, for the caller to
-- publish once replicas hold this script's writes (queue/replication.py)
-- Returns 1 (with ARGV[16]: the wake-up message), or 0 if the job was already terminal; error
-- 'LEASE_LOST' when another worker owns the model now.
if not holds_lease(KEYS[1], ARGV[1]) then
  return redis.error_reply('LEASE_LOST')
end
local seq = tonumber(ARGV[7])
local prefix, settled = ARGV[14], {KEYS[3], KEYS[5], KEYS[4]}
if ARGV[15] and ARGV[15] ~= '' then
  -- Before the outcome, as before the user hears of it: what the op made is on record.
  for _, fields in ipairs(cmsgpack.unpack(ARGV[15])) do
    redis.call('XADD', KEYS[6], '*', unpack(fields))
  end
end
if is_terminal(KEYS[2]) then
  advance_done(KEYS[3], KEYS[5], ARGV[9], seq)  -- cancelled while it ran inline
  settle_finished_after(settled, prefix, ARGV[9])
  return 0
end
local finished = now_text()
if ARGV[12] ~= '' then
  redis.call('HSET', KEYS[2], 'started_at', finished, 'worker_id', ARGV[12])
  redis.call('HINCRBY', KEYS[2], 'attempts', 1)
end
redis.call('HSET', KEYS[2], 'status', ARGV[2], 'finished_at', finished, 'result', ARGV[3])
if ARGV[2] == 'failed' then
  redis.call('HSET', KEYS[2], 'error', ARGV[4], 'error_category', ARGV[5], 'error_detail', ARGV[11])
  -- Keep what was asked, so the op can be retried from the dashboard.
  local entry = redis.call('XRANGE', KEYS[4], seq .. '-0', seq .. '-0')
  if entry[1] then
    local fields = entry[1][2]
    for i = 1, #fields, 2 do
      if fields[i] == 'payload' then
        redis.call('HSET', KEYS[2], 'payload', fields[i + 1])
      end
    end
  end
end
if ARGV[6] ~= '' then
  redis.call('HSET', KEYS[2], 'metrics', ARGV[6])
end
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[8]))
advance_done(KEYS[3], KEYS[5], ARGV[9], seq)
settle_finished_after(settled, prefix, ARGV[9])
if ARGV[10] ~= '' then
  redis.call('XTRIM', KEYS[4], 'MINID', (tonumber(ARGV[10]) + 1) .. '-0')
end
local tokens = tonumber(ARGV[13])
local job = redis.call('HMGET', KEYS[2], 'id', 'tenant_id')
redis.call('SREM', tenant_key(prefix, job[2], 'running'), job[1])
charge_tokens(prefix, job[2], tokens)
count_published(prefix, KEYS[2], ARGV[2], finished, tokens, job[2])
record_job(KEYS[2], KEYS[6])
local wake_up = cmsgpack.pack({job[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[11]})
if ARGV[16] == '1' then
  return wake_up
end
redis.call('PUBLISH', KEYS[7], wake_up)
return 1
