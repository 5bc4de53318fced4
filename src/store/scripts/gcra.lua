-- GCRA (generic cell rate algorithm): O(1) memory, smooth. Per limit one string: the theoretical
-- arrival time (TAT), microseconds of store time. Emission interval T = window / quota; a request
-- of cost c is admitted when max(TAT, now) + c*T - now <= window (a fresh caller may spend quota).
--
-- KEYS[i]     the TAT of limit i (all keys share one hash tag)
-- ARGV[1]     cost (integer >= 1)
-- ARGV[2i]    quota of limit i
-- ARGV[2i+1]  window of limit i, microseconds
-- Returns     {admitted (0|1), retry_after_us, remaining_1, reset_us_1, ...}
-- Cost        O(limits); per limit GET, plus SET PX when admitted.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cost = tonumber(ARGV[1])
local n = #KEYS
local tats = {}
local admitted = 1
local retry = 0
-- tolerance for the rounding of a fractional emission interval
local eps = 1

for i = 1, n do
  local quota = tonumber(ARGV[2 * i])
  local window = tonumber(ARGV[2 * i + 1])
  local interval = window / quota
  local tat = tonumber(redis.call('GET', KEYS[i]) or 0)
  if tat < now then tat = now end
  tats[i] = tat
  local new_tat = tat + cost * interval
  if new_tat - now > window + eps then
    admitted = 0
    local wait = new_tat - window - now
    if cost > quota then wait = window end
    if wait > retry then retry = wait end
  end
end

local result = {admitted, math.ceil(retry)}
for i = 1, n do
  local quota = tonumber(ARGV[2 * i])
  local window = tonumber(ARGV[2 * i + 1])
  local interval = window / quota
  local tat = tats[i]
  if admitted == 1 then
    tat = tat + cost * interval
    -- stored rounded down, so rounding never denies what exact arithmetic admits
    redis.call('SET', KEYS[i], string.format('%.0f', math.floor(tat)),
      'PX', math.ceil((tat - now) / 1000) + 1)
  end
  local used = (tat - now) / interval
  local whole = math.ceil(used - 1e-6)
  local remaining = quota - whole
  if remaining < 0 then remaining = 0 end
  local reset = 0
  if whole > 0 then reset = (tat - now) - (whole - 1) * interval end
  result[#result + 1] = remaining
  result[#result + 1] = math.ceil(reset)
end
return result
