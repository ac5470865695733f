-- Give up on missing seq_ids: the model's order resumes at its lowest held op. For a client
-- that numbered requests it then never sent (a submit that failed on its side), so the ops
-- after the gap do not wait forever. The gateway calls it only after a gap outlived its timeout.
-- KEYS[1] model meta hash   KEYS[2] model ops stream   KEYS[3] model lease
-- KEYS[4] offers zset       KEYS[5] pending set        KEYS[6] records stream
-- KEYS[7] held ops hash
-- ARGV[1] ttl seconds   ARGV[2] model id   ARGV[3] key prefix
-- Returns {first skipped seq_id, seq_id resumed at}, or {} when nothing is held.
local held = redis.call('HKEYS', KEYS[7])
if #held == 0 then
  return {}
end
local lowest = math.huge
for _, key in ipairs(held) do
  lowest = math.min(lowest, tonumber(key))
end
local missing = tonumber(redis.call('HGET', KEYS[1], 'next_seq_id') or '1')
local ttl = tonumber(ARGV[1])
local log = {KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]}
local next_id = admit_held(KEYS[7], lowest, log, ARGV[3], ttl, ARGV[2])
redis.call('HSET', KEYS[1], 'next_seq_id', next_id)
return {missing, lowest}
