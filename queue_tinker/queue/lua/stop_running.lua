-- Ask the worker running an op to stop it at its next step (a sample in the decode loop): one
-- entry on that worker's control stream. The worker fails the op with the reason given and
-- publishes it as usual (fenced by its lease). The reason is kept on the job too: if that
-- worker dies before it reads the stop, the next owner fails the op instead of re-running it
-- (start.lua).
-- KEYS[1] job hash   KEYS[2] control stream of the worker the caller read in the job hash
-- ARGV[1] tenant id ('' = any: an admin)   ARGV[2] the error message   ARGV[3] that worker's id
-- ARGV[4] control stream length (approximate MAXLEN)   ARGV[5..] the kinds that can be stopped
-- Returns 1 asked; error 'UNKNOWN_JOB' (missing, or another tenant's), 'NOT_RUNNING:<status>',
-- 'NOT_STOPPABLE:<kind>' or 'MOVED' (another worker runs it now: read the job again).
local job = redis.call('HMGET', KEYS[1], 'id', 'tenant_id', 'status', 'kind', 'worker_id')
if not job[1] or (ARGV[1] ~= '' and job[2] ~= ARGV[1]) then
  return redis.error_reply('UNKNOWN_JOB')
end
if job[3] ~= 'running' then
  return redis.error_reply('NOT_RUNNING:' .. (job[3] or '?'))
end
local stoppable = false
for i = 5, #ARGV do
  if ARGV[i] == job[4] then stoppable = true end
end
if not stoppable then
  return redis.error_reply('NOT_STOPPABLE:' .. (job[4] or '?'))
end
if job[5] ~= ARGV[3] then
  return redis.error_reply('MOVED')
end
redis.call('HSET', KEYS[1], 'stop_reason', ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'command', 'cancel', 'job', job[1],
  'reason', ARGV[2])
return 1
