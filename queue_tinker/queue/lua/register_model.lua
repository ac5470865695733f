-- Create a model's meta record once; a second call with the same id is a no-op. A "model" is
-- any ordered queue: a training run (lora config) or a sampling session (model path).
-- KEYS[1] model meta hash   KEYS[2] records stream   KEYS[3] set of every base model in use
-- ARGV[1] model id   ARGV[2] base model   ARGV[3] tenant id   ARGV[4] session id ('' = none)
-- ARGV[5] lora config (JSON text; training runs)   ARGV[6] kind ('training' / 'sampling')
-- ARGV[7] model path (sampling sessions; '' = the base model)
-- ARGV[8] user metadata (JSON text; training runs; '' = none)
-- ARGV[9] the training run whose inflight weights a sampling session follows ('' = none)
-- ARGV[10] the base model as the user named it: ARGV[2] with any :peft:<tokens> cap; the meta's
--   base_model is the base the queue routes by, the records keep the name as written
-- Returns 1 if created, 0 if it already existed.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
local now = now_text()
redis.call('SADD', KEYS[3], ARGV[2])
redis.call('HSET', KEYS[1], 'base_model', ARGV[2], 'tenant_id', ARGV[3], 'last_seq', 0,
  'done_seq', 0, 'created_at', now, 'kind', ARGV[6], 'lora_config', ARGV[5],
  'model_path', ARGV[7], 'user_metadata', ARGV[8], 'inflight_of', ARGV[9],
  'model_name', ARGV[10])
if ARGV[6] == 'sampling' then
  redis.call('XADD', KEYS[2], '*', 'type', 'sampling_session', 'id', ARGV[1], 'tenant_id',
    ARGV[3], 'session_id', ARGV[4], 'base_model', ARGV[10], 'model_path', ARGV[7],
    'created_at', now)
else
  redis.call('XADD', KEYS[2], '*', 'type', 'model', 'id', ARGV[1], 'tenant_id', ARGV[3],
    'session_id', ARGV[4], 'base_model', ARGV[10], 'lora_config', ARGV[5], 'user_metadata', ARGV[8],
    'created_at', now)
end
return 1
