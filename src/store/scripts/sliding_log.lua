-- Sliding-window log: exact. One sorted set per limit; a member per unit of admitted cost,
-- scored with the store's time in microseconds.
--
-- KEYS[i]     the log of limit i (all keys share one hash tag)
-- ARGV[1]     cost (integer >= 1)
-- ARGV[2]     a random nonce, unique per request (members are nonce..":"..n)
-- ARGV[1+2i]  quota of limit i
-- ARGV[2+2i]  window of limit i, microseconds
-- Returns     {admitted (0|1), retry_after_us, remaining_1, reset_us_1, remaining_2, reset_us_2, ...}
-- Cost        O(limits * log(entries)); per admitted limit: ZREMRANGEBYSCORE, ZCARD, ZADD, PEXPIRE,
--             plus ZRANGE when the log was not empty; denied requests write nothing.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cost = tonumber(ARGV[1])
local n = #KEYS
local counts = {}
local admitted = 1
local retry = 0

local function oldest(key)
  local e = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  return tonumber(e[2])
end

for i = 1, n do
  local quota = tonumber(ARGV[1 + 2 * i])
  local window = tonumber(ARGV[2 + 2 * i])
  -- An entry scored s covers (s - window, s]; it is gone once now - window >= s.
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', string.format('%.0f', now - window))
  local count = redis.call('ZCARD', KEYS[i])
  counts[i] = count
  if count + cost > quota then
    admitted = 0
    local wait = window
    if cost <= quota then
      -- room appears once the (count + cost - quota) oldest entries have left the window
      local idx = count + cost - quota - 1
      local e = redis.call('ZRANGE', KEYS[i], idx, idx, 'WITHSCORES')
      wait = tonumber(e[2]) + window - now
    end
    if wait > retry then retry = wait end
  end
end

local result = {admitted, retry}
local score = string.format('%.0f', now)
for i = 1, n do
  local quota = tonumber(ARGV[1 + 2 * i])
  local window = tonumber(ARGV[2 + 2 * i])
  local count = counts[i]
  local reset = 0
  if admitted == 1 then
    local args = {}
    for c = 1, cost do
      args[#args + 1] = score
      args[#args + 1] = ARGV[2] .. ':' .. c
      if #args >= 1000 then
        redis.call('ZADD', KEYS[i], unpack(args))
        args = {}
      end
    end
    if #args > 0 then redis.call('ZADD', KEYS[i], unpack(args)) end
    redis.call('PEXPIRE', KEYS[i], math.ceil(window / 1000))
    count = count + cost
    if counts[i] == 0 then reset = window else reset = oldest(KEYS[i]) + window - now end
  elseif count > 0 then
    reset = oldest(KEYS[i]) + window - now
  end
  local remaining = quota - count
  if remaining < 0 then remaining = 0 end
  result[#result + 1] = remaining
  result[#result + 1] = reset
end
return result
