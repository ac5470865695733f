-- Shared prelude, prepended to every script by queue_tinker/queue/scripts.py.

-- Server time as 'seconds.micros', so every timestamp in a job comes from one clock.
local function now_text()
  local t = redis.call('TIME')
  return string.format('%d.%06d', tonumber(t[1]), tonumber(t[2]))
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Key names a script builds itself (it learns the tenant or job only inside); the same names
-- as queue/keys.py, which tests/test_keys.py checks.
local function meta_key(prefix, model_id) return prefix .. ':model:' .. model_id .. ':meta' end
local function lease_key(prefix, model_id) return prefix .. ':model:' .. model_id .. ':lease' end
local function events_key(prefix, model_id)
  return prefix .. ':model:' .. model_id .. ':events'
end
local function job_key(prefix, job_id) return prefix .. ':job:' .. job_id end
local function offers_key(prefix, base) return prefix .. ':base:' .. base .. ':offers' end
local function limits_key(prefix, tenant) return prefix .. ':limits:' .. tenant end
local function tenant_key(prefix, tenant, what)
  return prefix .. ':tenant:' .. tenant .. ':' .. what
end

-- Offer a model to the workers of its base: the offers zset, plus a bell entry that wakes
-- every idle one of them to pick the fairest offer.
local function offer(offers, model_id)
  if redis.call('ZADD', offers, 'NX', now_ms(), model_id) == 1 then
    redis.call('XADD', offers .. ':bell', 'MAXLEN', '~', 100, '*', 'm', model_id)
  end
end

-- Copy the job hash (minus its result and payload bytes, and a running op's stop request:
-- the failure it leads to is recorded) onto the records stream, for Postgres.
local function record_job(job_key, records_key)
  local flat = redis.call('HGETALL', job_key)
  local event = {'type', 'request'}
  for i = 1, #flat, 2 do
    if flat[i] ~= 'result' and flat[i] ~= 'payload' and flat[i] ~= 'stop_reason' then
      event[#event + 1] = flat[i]
      event[#event + 1] = flat[i + 1]
    end
  end
  redis.call('XADD', records_key, '*', unpack(event))
end

-- The lease check every fenced write starts with: only the token's holder may write.
local function holds_lease(lease_key, token)
  return redis.call('GET', lease_key) == token
end

local function is_terminal(job_key)
  local status = redis.call('HGET', job_key, 'status')
  return status == 'done' or status == 'failed'
end

-- Write a job hash's 'queued' fields; an op that waited for its turn keeps its arrival time.
local function write_queued_job(job_key, job_id, kind, model_id, meta_key, ttl)
  redis.call('HSET', job_key, 'id', job_id, 'model_id', model_id, 'kind', kind,
    'status', 'queued', 'tenant_id', redis.call('HGET', meta_key, 'tenant_id'), 'attempts', 0)
  redis.call('HSETNX', job_key, 'queued_at', now_text())
  redis.call('EXPIRE', job_key, ttl)
end

-- Append one op to a model's log: assign the next seq, write the job, offer the model if
-- unowned. The caller has checked that the model exists and that the op is no duplicate.
-- k = {meta, ops, job, lease, offers, pending, records}
local function append_op(k, job_id, kind, payload, ttl, model_id)
  local seq = redis.call('HINCRBY', k[1], 'last_seq', 1)
  write_queued_job(k[3], job_id, kind, model_id, k[1], ttl)
  redis.call('HSET', k[3], 'seq', seq)
  redis.call('XADD', k[2], seq .. '-0', 'job', job_id, 'kind', kind, 'payload', payload)
  redis.call('SADD', k[6], model_id)
  if redis.call('EXISTS', k[4]) == 0 then
    offer(k[5], model_id)
  end
  record_job(k[3], k[7])
  return seq
end

-- Append an op that took its turn in a client's seq_id order; an empty job id is a seq_id
-- consumed without an op (a request refused at the door), and so is an op cancelled while it
-- was held (cancel.lua: appending it would make it queued again). The job key is built from
-- the key prefix because ops held earlier are only known here.
-- log = {meta, ops, lease, offers, pending, records}
local function admit_op(log, prefix, job_id, kind, payload, ttl, model_id)
  local key = job_key(prefix, job_id)
  if job_id ~= '' and not is_terminal(key) then
    append_op({log[1], log[2], key, log[3], log[4], log[5], log[6]},
      job_id, kind, payload, ttl, model_id)
  end
end

-- Admit held ops (seq_id -> packed {job id, kind, payload}) from `next_id` on while there is
-- no gap; returns the seq_id still missing.
local function admit_held(held_key, next_id, log, prefix, ttl, model_id)
  while true do
    local entry = redis.call('HGET', held_key, next_id)
    if not entry then
      return next_id
    end
    redis.call('HDEL', held_key, next_id)
    local op = cmsgpack.unpack(entry)
    admit_op(log, prefix, op[1], op[2], op[3], ttl, model_id)
    next_id = next_id + 1
  end
end

-- A model's ops up to `seq` are settled: done_seq moves there (never back), and the model
-- leaves the pending set when nothing after it is queued.
local function advance_done(meta, pending, model_id, seq)
  if tonumber(redis.call('HGET', meta, 'done_seq') or '0') < seq then
    redis.call('HSET', meta, 'done_seq', seq)
  end
  if tonumber(redis.call('HGET', meta, 'last_seq') or '0') <= seq then
    redis.call('SREM', pending, model_id)
  end
end

-- done_seq moves on over the ops right after it that finished before their turn came
-- (cancelled while they waited): start.lua leaves those to the publish of the op before them,
-- which calls this. k = {meta, pending, ops}
local function settle_finished_after(k, prefix, model_id)
  while true do
    local next_seq = tonumber(redis.call('HGET', k[1], 'done_seq') or '0') + 1
    local entry = redis.call('XRANGE', k[3], next_seq .. '-0', next_seq .. '-0')[1]
    if not entry then
      return
    end
    local job_id
    for i = 1, #entry[2], 2 do
      if entry[2][i] == 'job' then job_id = entry[2][i + 1] end
    end
    if not job_id or not is_terminal(job_key(prefix, job_id)) then
      return
    end
    advance_done(k[1], k[2], model_id, next_seq)
  end
end

-- --- per-tenant limits (queue/control/limits.py) -----------------------------------------

-- A tenant's limit on `field`, 0 for none: its own, else the default tenant '*'s.
local function tenant_limit(prefix, tenant, field)
  local value = redis.call('HGET', limits_key(prefix, tenant), field)
  if not value then
    value = redis.call('HGET', limits_key(prefix, '*'), field)
  end
  return tonumber(value or '0') or 0
end

-- The tenant's training runs some worker holds; a lease that lapsed (its worker died) drops
-- out here, so a dead worker never keeps a slot.
local function leased_runs(prefix, tenant)
  local key = tenant_key(prefix, tenant, 'leased')
  local runs = 0
  for _, model_id in ipairs(redis.call('SMEMBERS', key)) do
    if redis.call('EXISTS', lease_key(prefix, model_id)) == 0 then
      redis.call('SREM', key, model_id)
    elseif redis.call('HGET', meta_key(prefix, model_id), 'kind') == 'training' then
      runs = runs + 1
    end
  end
  return runs
end

-- The tenant's ops running now; one whose job finished or whose model's lease lapsed drops out.
local function running_ops(prefix, tenant)
  local key = tenant_key(prefix, tenant, 'running')
  local running = 0
  for _, job_id in ipairs(redis.call('SMEMBERS', key)) do
    local job = redis.call('HMGET', job_key(prefix, job_id), 'status', 'model_id')
    if job[1] ~= 'running' or redis.call('EXISTS', lease_key(prefix, job[2])) == 0 then
      redis.call('SREM', key, job_id)
    else
      running = running + 1
    end
  end
  return running
end

-- The tenant's token bucket now: it refills at `rate` tokens/s up to one second's worth; a
-- new bucket starts full. Ops are charged when they finish (their token count is known then),
-- so the level may go below zero: the tenant then waits until it is paid off.
local function bucket_level(prefix, tenant, rate, now)
  local bucket = redis.call('HMGET', tenant_key(prefix, tenant, 'bucket'), 'level', 'at_ms')
  local level = tonumber(bucket[1] or rate)
  local at = tonumber(bucket[2] or now)
  return math.min(rate, level + rate * (now - at) / 1000)
end

-- Why the tenant may not start another op now ('' when it may), and when to look again (ms).
-- An in-flight slot frees when an op finishes, possibly on another worker: look every 100 ms.
-- A bucket in debt is looked at again when it has refilled, but at least every second, so a
-- limit raised meanwhile takes effect soon.
local function op_refusal(prefix, tenant, job_id)
  local running = tenant_key(prefix, tenant, 'running')
  local max_ops = tenant_limit(prefix, tenant, 'inflight_ops')
  if max_ops > 0 and redis.call('SISMEMBER', running, job_id) == 0
      and redis.call('SCARD', running) >= max_ops and running_ops(prefix, tenant) >= max_ops then
    return 'in-flight ops rate limit hit (' .. max_ops .. ' running at once)', 100
  end
  local rate = tenant_limit(prefix, tenant, 'tokens_per_s')
  if rate > 0 then
    local level = bucket_level(prefix, tenant, rate, now_ms())
    if level < 0 then
      return 'tokens per second rate limit hit (' .. rate .. ' tokens/s)',
        math.min(1000, math.ceil(-level / rate * 1000))
    end
  end
  return '', 0
end

-- Charge a finished op's tokens to its tenant's bucket (when the tenant has a token limit).
local function charge_tokens(prefix, tenant, tokens)
  local rate = tenant_limit(prefix, tenant, 'tokens_per_s')
  if rate > 0 and tokens > 0 then
    local now = now_ms()
    redis.call('HSET', tenant_key(prefix, tenant, 'bucket'), 'level',
      bucket_level(prefix, tenant, rate, now) - tokens, 'at_ms', now)
  end
end

-- --- fleet-wide counters for /metrics (queue/observe/metrics.py reads them) -----------------

local function count_published(prefix, job, status, finished, tokens, tenant)
  local kind = redis.call('HGET', job, 'kind')
  redis.call('HINCRBY', prefix .. ':metrics:ops', kind .. '|' .. status, 1)
  local seconds = tonumber(finished) - tonumber(redis.call('HGET', job, 'queued_at') or finished)
  local bucket = #LATENCY_BUCKETS_S + 1
  for i, bound in ipairs(LATENCY_BUCKETS_S) do
    if seconds <= bound then
      bucket = i
      break
    end
  end
  local latency = prefix .. ':metrics:latency:' .. kind
  redis.call('HINCRBY', latency, 'b' .. bucket, 1)
  redis.call('HINCRBY', latency, 'count', 1)
  redis.call('HINCRBYFLOAT', latency, 'sum_s', seconds)
  if tokens > 0 then
    redis.call('HINCRBY', prefix .. ':metrics:tokens', kind, tokens)
    redis.call('HINCRBY', prefix .. ':metrics:tenant-tokens', tenant, tokens)
  end
end
