-- Idempotency: store the response of a request whose claim this owner still holds.
--
-- KEYS[1]  the idempotency record (see idem_begin.lua)
-- KEYS[2]  its pending marker (see idem_begin.lua)
-- ARGV[1]  the owner token
-- ARGV[2]  the encoded response
-- ARGV[3]  retention of the completed record in milliseconds
-- ARGV[4]  lifetime of the pending marker in milliseconds; 0 for a record no replica must
--          acknowledge
-- ARGV[5]  the deadline in microseconds of store time: received from then on, the call does
--          nothing
-- Returns  1 when stored (now, or by an earlier run of this completion); 0 when the claim is no
--          longer this owner's (its lease ran out, and it expired or another request took it
--          over), or the record is done with another response: nothing is written then; -1
--          when received after the deadline
-- Cost     O(1): TIME, HMGET, then PEXPIRE and HSET (a second run: HGET of the response
--          instead).
--
-- Safe to run twice: the token stays in the completed record, so a second run of the same
-- completion (the same response) answers "stored" without writing. The expiry is set before the fields, so that a
-- refused expiry leaves the record as it was.
-- too late: the caller gave up on this call at its deadline
local t = redis.call('TIME')
if tonumber(t[1]) * 1000000 + tonumber(t[2]) >= tonumber(ARGV[5]) then return -1 end
local rec = redis.call('HMGET', KEYS[1], 's', 't')
if rec[2] ~= ARGV[1] then return 0 end
if rec[1] == 'done' then
  -- a second run of this completion stored this very response; another one is refused
  if redis.call('HGET', KEYS[1], 'r') ~= ARGV[2] then return 0 end
  -- a durable re-run writes its marker again: the write that its WAIT waits for
  if tonumber(ARGV[4]) > 0 then redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[4]) end
  return 1
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('HSET', KEYS[1], 's', 'done', 'r', ARGV[2])
if tonumber(ARGV[4]) > 0 then redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[4]) end
return 1
