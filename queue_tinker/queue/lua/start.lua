-- Mark a job running, fenced by the lease.
-- KEYS[1] model lease   KEYS[2] job hash   KEYS[3] records stream
-- ARGV[1] token   ARGV[2] worker id
-- Returns 1 started, 0 the job is already terminal (skip it); error 'LEASE_LOST'.
if not holds_lease(KEYS[1], ARGV[1]) then
  return redis.error_reply('LEASE_LOST')
end
if is_terminal(KEYS[2]) then
  return 0
end
redis.call('HSET', KEYS[2], 'status', 'running', 'started_at', now_text(), 'worker_id', ARGV[2])
redis.call('HINCRBY', KEYS[2], 'attempts', 1)
record_job(KEYS[2], KEYS[3])
return 1
