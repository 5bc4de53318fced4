-- Limits copies: the copies of a rate-limit layer that registered themselves, each with what it
-- was built with and until when it counts as alive; a registration drops those whose time is
-- over.
--
-- KEYS[1]  the copies: a hash of copy id -> "<until, ms of store time> <built>"
-- ARGV[1]  `register` or `list`
-- ARGV[2]  (register) the copy's id
-- ARGV[3]  (register) what it was built with
-- ARGV[4]  (register) how long it counts as alive, in milliseconds
-- Returns  register: 1; list: {id, ms left, built, ...} of the copies alive
-- Cost     O(copies registered)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local register = ARGV[1] == 'register'
local all = redis.call('HGETALL', KEYS[1])
local alive = {}
for i = 1, #all, 2 do
  local until_ms, built = string.match(all[i + 1], '^(%d+) (.*)$')
  if until_ms and tonumber(until_ms) > now then
    alive[#alive + 1] = all[i]
    alive[#alive + 1] = tonumber(until_ms) - now
    alive[#alive + 1] = built
  elseif register then
    redis.call('HDEL', KEYS[1], all[i])
  end
end
if not register then return alive end
local ttl = tonumber(ARGV[4])
redis.call('HSET', KEYS[1], ARGV[2], string.format('%d', now + ttl) .. ' ' .. ARGV[3])
if redis.call('PTTL', KEYS[1]) < ttl then redis.call('PEXPIRE', KEYS[1], ttl) end
return 1
