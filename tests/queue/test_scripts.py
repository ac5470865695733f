"""scripts.run_pipelined on real Redis: EVALSHA in one round trip, replies and errors in call
order, and a script the server lost (SCRIPT FLUSH, a restart) loaded again with only the calls
it refused retried, so none runs twice."""

from __future__ import annotations

import uuid

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from queue_tinker.queue.scripts import run_pipelined

# A script of this test's own (a fresh SHA), so flushing shows the retry: it appends its
# argument to a list and answers the list's length, or fails where asked to.
SOURCE = """
if ARGV[1] == 'fail' then return redis.error_reply('ASKED_TO_FAIL') end
return redis.call('RPUSH', KEYS[1], ARGV[1])
"""


async def test_calls_run_once_each_in_order_after_the_script_cache_is_flushed(
    aredis: Redis, key_prefix: str
) -> None:
    script = aredis.register_script(f"-- {uuid.uuid4().hex}\n{SOURCE}")
    key = f"{key_prefix}:calls"
    await aredis.script_flush()  # the server forgets every script: the first try is refused
    calls = [([key], [name]) for name in ("a", "b", "fail", "c")]
    replies = await run_pipelined(aredis, script, calls)
    assert replies[:2] == [1, 2] and replies[3] == 3
    assert isinstance(replies[2], ResponseError) and "ASKED_TO_FAIL" in str(replies[2])
    assert await aredis.lrange(key, 0, -1) == [b"a", b"b", b"c"]
    # Loaded now: the next batch is answered on the first try, after the first batch.
    assert await run_pipelined(aredis, script, [([key], ["d"])]) == [4]
    assert await aredis.lrange(key, 0, -1) == [b"a", b"b", b"c", b"d"]
