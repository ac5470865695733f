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
