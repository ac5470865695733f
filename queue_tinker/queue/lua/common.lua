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

-- Copy the job hash (minus its result bytes) onto the records stream, for Postgres.
local function record_job(job_key, records_key)
  local flat = redis.call('HGETALL', job_key)
  local event = {'type', 'request'}
  for i = 1, #flat, 2 do
    if flat[i] ~= 'result' then
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
    redis.call('ZADD', k[5], 'NX', now_ms(), model_id)
  end
  record_job(k[3], k[7])
  return seq
end

-- Append an op that took its turn in a client's seq_id order; an empty job id is a seq_id
-- consumed without an op (a request refused at the door). The job key is built from the key
-- prefix because ops held earlier are only known here.
-- log = {meta, ops, lease, offers, pending, records}
local function admit_op(log, prefix, job_id, kind, payload, ttl, model_id)
  if job_id ~= '' then
    append_op({log[1], log[2], prefix .. ':job:' .. job_id, log[3], log[4], log[5], log[6]},
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
