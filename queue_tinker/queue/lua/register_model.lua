-- Create a model's meta record once; a second call with the same id is a no-op.
-- KEYS[1] model meta hash   KEYS[2] records stream
-- ARGV[1] model id   ARGV[2] base model   ARGV[3] tenant id   ARGV[4] session id ('' = none)
-- ARGV[5] lora config (JSON text)
-- Returns 1 if created, 0 if it already existed.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
local now = now_text()
redis.call('HSET', KEYS[1], 'base_model', ARGV[2], 'tenant_id', ARGV[3], 'last_seq', 0,
  'done_seq', 0, 'created_at', now, 'lora_config', ARGV[5])
redis.call('XADD', KEYS[2], '*', 'type', 'model', 'id', ARGV[1], 'tenant_id', ARGV[3],
  'session_id', ARGV[4], 'base_model', ARGV[2], 'lora_config', ARGV[5], 'created_at', now)
return 1
