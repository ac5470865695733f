-- Mark a job running, fenced by the lease, unless its tenant is over a limit (in-flight ops,
-- tokens per second): then the job stays queued and the model is paused with the reason.
-- KEYS[1] model lease   KEYS[2] job hash   KEYS[3] records stream   KEYS[4] model meta
-- KEYS[5] pending set of the base
-- ARGV[1] token   ARGV[2] worker id   ARGV[3] key prefix   ARGV[4] seq   ARGV[5] model id
-- ARGV[6] most starts an op gets: one started that often already ended every worker that ran it
-- Returns {1} started; {3, reason} started, but a stop was asked while an earlier owner ran it
-- (stop_running.lua): fail it with the reason, do not run it; {4, attempts} started, but it
-- was started ARGV[6] times already and never finished: fail it unrun, so it cannot end every
-- worker in turn; {0} the job is already terminal (skip it: an earlier owner finished it, or
-- it was cancelled); {2, retry after ms} over a limit; error 'LEASE_LOST'.
if not holds_lease(KEYS[1], ARGV[1]) then
  return redis.error_reply('LEASE_LOST')
end
local seq = tonumber(ARGV[4])
if is_terminal(KEYS[2]) then
  -- Settled now only if every op before it is: an earlier one may still run beside it (samples
  -- run together), and a new owner reads the log from done_seq. Else the publish of the op
  -- before it settles it (settle_finished_after).
  if tonumber(redis.call('HGET', KEYS[4], 'done_seq') or '0') >= seq - 1 then
    advance_done(KEYS[4], KEYS[5], ARGV[5], seq)
  end
  return {0}
end
local prefix = ARGV[3]
local job = redis.call('HMGET', KEYS[2], 'id', 'tenant_id', 'stop_reason', 'attempts')
local attempts = tonumber(job[4] or '0')
local spent = attempts >= tonumber(ARGV[6])
local reason, retry_ms = '', 0
if not job[3] and not spent then  -- an op that will not run waits for no limit
  reason, retry_ms = op_refusal(prefix, job[2], job[1])
end
if reason ~= '' then
  redis.call('HSET', KEYS[4], 'paused_reason', reason)
  return {2, retry_ms}
end
redis.call('HDEL', KEYS[4], 'paused_reason')
redis.call('SADD', tenant_key(prefix, job[2], 'running'), job[1])
redis.call('HSET', KEYS[2], 'status', 'running', 'started_at', now_text(), 'worker_id', ARGV[2])
redis.call('HINCRBY', KEYS[2], 'attempts', 1)
record_job(KEYS[2], KEYS[3])
if job[3] then
  return {3, job[3]}
end
if spent then
  return {4, attempts}
end
return {1}
