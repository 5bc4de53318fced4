-- GCRA script of the previous release (46da7fc), kept to measure against: benches/rate.rs.
-- GCRA (generic cell rate algorithm): O(1) memory, smooth. Emission interval T = window / quota;
-- a request of cost c is admitted when max(TAT, now) + c*T - now <= window (a fresh caller may
-- spend the whole quota at once). Kept exact in integers: per limit one string
-- "<tat>:<rem>:<attempt>", the theoretical arrival time in whole microseconds of store time plus
-- rem/quota of a microsecond, and the id of the attempt that set it. Offsets from now are counted
-- in 1/quota microseconds, where T is exactly `window` units.
--
-- Safe to run twice: when the first limit was last charged by this very attempt (a re-sent
-- command), the attempt is admitted again without a second charge.
--
-- KEYS[i]     the TAT of limit i (all keys share one hash tag)
-- ARGV[1]     cost (integer >= 1)
-- ARGV[2]     the attempt id (16 hex digits)
-- ARGV[1+2i]  quota of limit i
-- ARGV[2+2i]  window of limit i, microseconds (quota * window < 2^52: exact in a double)
-- Returns     {admitted (0|1), retry_after_us, remaining_1, reset_us_1, ...}
-- Cost        O(limits); per limit GET, plus SET PX when admitted.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cost = tonumber(ARGV[1])
local n = #KEYS
local attempt = ARGV[2]
local tats, rems = {}, {}
local admitted = 1
local retry = 0
local replay = false

-- ceil(a / b) for integers 0 <= a, 0 < b below 2^53, exact whatever the rounding of a / b
local function ceil_div(a, b)
  local q = math.floor(a / b)
  if q * b > a then q = q - 1 end
  if q * b < a then q = q + 1 end
  return q
end

for i = 1, n do
  local quota = tonumber(ARGV[1 + 2 * i])
  local window = tonumber(ARGV[2 + 2 * i])
  local tat, rem = now, 0
  local raw = redis.call('GET', KEYS[i])
  if raw then
    local stored, r, by = string.match(raw, '^(%d+):(%d+):?(%x*)$')
    stored = tonumber(stored)
    if stored >= now then tat, rem = stored, tonumber(r) end
    if i == 1 and by == attempt then replay = true end
  end
  tats[i], rems[i] = tat, rem
  if replay then
    -- charged by the first run of this attempt: nothing to decide
  elseif cost > quota then
    admitted = 0
    if window > retry then retry = window end
  else
    local ahead = (tat - now) * quota + rem + cost * window
    if ahead > window * quota then
      admitted = 0
      local wait = ceil_div(ahead - window * quota, quota)
      if wait > retry then retry = wait end
    end
  end
end

if replay then admitted, retry = 1, 0 end
local result = {admitted, retry}
for i = 1, n do
  local quota = tonumber(ARGV[1 + 2 * i])
  local window = tonumber(ARGV[2 + 2 * i])
  local tat, rem = tats[i], rems[i]
  -- a cost of 0 only looks: nothing is written
  if admitted == 1 and not replay and cost > 0 then
    local units = rem + cost * window
    local whole = math.floor(units / quota)
    if whole * quota > units then whole = whole - 1 end
    tat = tat + whole
    rem = units - whole * quota
    redis.call('SET', KEYS[i], string.format('%d:%d:%s', tat, rem, attempt),
      'PX', string.format('%d', math.ceil((tat - now) / 1000) + 1))
  end
  local ahead = (tat - now) * quota + rem
  local used = ceil_div(ahead, window)
  local remaining = quota - used
  if remaining < 0 then remaining = 0 end
  local reset = 0
  -- the next unit frees when the offset drops to (used - 1) emission intervals
  if used > 0 then reset = ceil_div(ahead - (used - 1) * window, quota) end
  result[#result + 1] = remaining
  result[#result + 1] = reset
end
return result
