-- Cancel a queued op: it fails as cancelled, its waiters wake, and whoever owns the model skips
-- it (start.lua finds it terminal). An op held for an earlier seq_id (queued, no seq yet) is
-- cancelled the same way: it stays held and takes its turn without entering the log
-- (admit_op). An op already running or finished is not cancelled.
-- KEYS[1] job hash   KEYS[2] records stream
-- ARGV[1] tenant id ('' = any: an admin)   ARGV[2] the error message   ARGV[3] key prefix
-- Returns 1 cancelled; error 'UNKNOWN_JOB' (missing, or another tenant's) or 'NOT_QUEUED:<status>'.
local job = redis.call('HMGET', KEYS[1], 'id', 'tenant_id', 'status', 'model_id', 'seq')
if not job[1] or (ARGV[1] ~= '' and job[2] ~= ARGV[1]) then
  return redis.error_reply('UNKNOWN_JOB')
end
if job[3] ~= 'queued' then
  return redis.error_reply('NOT_QUEUED:' .. (job[3] or '?'))
end
redis.call('HSET', KEYS[1], 'status', 'failed', 'finished_at', now_text(), 'error', ARGV[2],
  'error_category', 'user', 'error_detail', '')
record_job(KEYS[1], KEYS[2])
redis.call('PUBLISH', events_key(ARGV[3], job[4]),
  cmsgpack.pack({job[1], 'failed', '', ARGV[2], 'user', ''}))
return 1
