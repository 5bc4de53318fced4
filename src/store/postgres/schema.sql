-- tollgate on PostgreSQL, schema version 3: tables, indexes and the functions that are the
-- store's atomic operations. `__SCHEMA__` stands for the configured schema (quoted) and
-- `__RATE_TABLES__` for `UNLOGGED` or nothing. Every statement is idempotent. PgStore::migrate
-- first reads the version recorded in `migrations` (locking none of the tables below) and runs
-- this file only when the schema is older, its rate tables are to change persistence, or a
-- function of version 1 is back (a copy of version 1 started since): in one transaction under
-- an advisory lock, so copies may run it at once.
--
-- Lock order: every function, the purge and the migration lock tables in this order, so that
-- no two of them can wait for each other in a cycle:
--   rate_limits, rate_log, holds, permits, permit_queue, fences, idempotency, releases
-- A rate check locks its rate_limits rows (in key order) before it touches rate_log. A claim,
-- lock, permit or idempotency call takes the advisory lock of its key (lock_key) before its
-- holds, permits or idempotency rows; lock_acquire and permit_acquire then write fences; a
-- release writes its releases row last.
-- purge_expired deletes table after table in this order (skipping locked rows), and a
-- migration locks every table that exists, in this order, before its first DDL.
--
-- Deadlines: every write function takes p_deadline_us, a time of the database clock in
-- microseconds. A call that reads the clock at or past it — after it has taken its locks, right
-- before it writes — changes nothing and answers "late": -1, or {-2, 0} from check_rate.
-- Version 2 added them; the functions of version 1, without p_deadline_us, are dropped here.
-- Version 3 added check_rates, a batch of rate checks in one call.
--
-- Time is the database clock in microseconds since the Unix epoch (`now_us()`, read from
-- `clock_timestamp()` after the rows an operation touches are locked). Every row has an
-- `expires_at` in that unit; a row whose `expires_at` has passed counts as absent, and
-- `purge_expired` deletes such rows in batches through an index on the expiry (on rate_limits,
-- on its purge mark `purge_at`, never before `expires_at`).
-- Durations arrive in milliseconds, clamped by the client to at most 2^53 (MAX_EXPIRY), so
-- that now + ms * 1000 stays below 2^63.

-- A migration waits for every running operation, then runs alone: one ACCESS EXCLUSIVE lock
-- per table, taken in the lock order above before any DDL (which would take weaker locks and
-- strengthen them later, in the order of this file).
DO $lock$
DECLARE
  t text;
BEGIN
  FOREACH t IN ARRAY ARRAY['rate_limits', 'rate_log', 'holds', 'permits', 'permit_queue',
                           'fences', 'idempotency', 'releases'] LOOP
    IF to_regclass('__SCHEMA__.' || t) IS NOT NULL THEN
      EXECUTE format('LOCK TABLE %s.%I IN ACCESS EXCLUSIVE MODE', '__SCHEMA__', t);
    END IF;
  END LOOP;
END $lock$;

DROP FUNCTION IF EXISTS __SCHEMA__.check_rate(smallint, text[], bigint[], bigint[], bigint, bigint);
DROP FUNCTION IF EXISTS __SCHEMA__.claim(text, text, bigint);
DROP FUNCTION IF EXISTS __SCHEMA__.lock_acquire(text, text, text, bigint, bigint);
DROP FUNCTION IF EXISTS __SCHEMA__.extend_hold(text, text, bigint);
DROP FUNCTION IF EXISTS __SCHEMA__.idem_begin(text, text, text, bigint);
DROP FUNCTION IF EXISTS __SCHEMA__.idem_complete(text, text, bytea, bigint);
DROP FUNCTION IF EXISTS __SCHEMA__.idem_extend(text, text, bigint);
DROP FUNCTION IF EXISTS __SCHEMA__.rate_sliding_counter(text[], bigint[], bigint[], bigint, bigint, bigint);
DROP FUNCTION IF EXISTS __SCHEMA__.rate_gcra(text[], bigint[], bigint[], bigint, bigint, bigint);

CREATE OR REPLACE FUNCTION __SCHEMA__.now_us() RETURNS bigint
LANGUAGE sql VOLATILE AS $$
  SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint
$$;

-- Takes, for the rest of the transaction, the advisory lock of key p_key: every write and
-- release of a claim, lock or idempotency record takes it first (see claim for why).
CREATE OR REPLACE FUNCTION __SCHEMA__.lock_key(p_key text) RETURNS void
LANGUAGE sql VOLATILE AS $$
  SELECT pg_advisory_xact_lock(hashtextextended(p_key, 8390043843661231205))
$$;

-- ceil(a / b) for 0 <= a, 0 < b
CREATE OR REPLACE FUNCTION __SCHEMA__.ceil_div(a bigint, b bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$ SELECT (a + b - 1) / b $$;

-- The purge mark of a rate row whose expiry becomes p_expires (see rate_limits): the old mark
-- p_old while it is still at or after the expiry by at most window / 16, else the expiry plus
-- window / 16 (without passing 2^63 - 1).
CREATE OR REPLACE FUNCTION __SCHEMA__.purge_mark(p_old bigint, p_expires bigint, p_window bigint)
RETURNS bigint LANGUAGE sql IMMUTABLE AS $$
  SELECT CASE
    WHEN p_old >= p_expires AND p_old - p_expires <= p_window / 16 THEN p_old
    ELSE p_expires + least(p_window / 16, 9223372036854775807 - p_expires)
  END
$$;

-- ---------------------------------------------------------------------------------------------
-- Rate limits: one row per caller and limit (the key of RatePolicy::store_keys). What a, b, c
-- hold depends on the algorithm (the key names it):
--   sliding log      a = units of cost in the log (its rows in rate_log)
--   sliding counter  a = window index, b = cost of that window, c = cost of the one before
--   GCRA             a = theoretical arrival time (µs), b = remainder in 1/quota µs
-- `recent` and `recent_until` are the attempts that charged the row lately and until when each
-- is remembered (its deadline, µs), oldest first, on a policy's first limit (counter, GCRA): a
-- re-sent attempt is found among them whatever charged the caller in between (see remember).
-- `attempt` is no longer written. A row with expires_at 0 is a placeholder, made only to be
-- locked.
-- ---------------------------------------------------------------------------------------------
CREATE __RATE_TABLES__ TABLE IF NOT EXISTS __SCHEMA__.rate_limits (
  key text PRIMARY KEY,
  a bigint NOT NULL DEFAULT 0,
  b bigint NOT NULL DEFAULT 0,
  c bigint NOT NULL DEFAULT 0,
  attempt bigint NOT NULL DEFAULT 0,
  expires_at bigint NOT NULL DEFAULT 0,
  purge_at bigint NOT NULL DEFAULT 0,
  recent bigint[] NOT NULL DEFAULT '{}',
  recent_until bigint[] NOT NULL DEFAULT '{}'
) WITH (fillfactor = 80);
-- `purge_at` is where purge_expired finds the row: never before `expires_at` (a row it finds
-- has expired) and at most 1/16 of the limit's window after it. It moves only when the expiry
-- passes it (or falls far below it), so that most updates leave every indexed column as it was
-- and stay HOT within the page room that the fillfactor keeps. A schema made before it gets it
-- here, set to the expiry.
DO $migrate$
BEGIN
  IF NOT EXISTS (
    SELECT 1 FROM pg_attribute
    WHERE attrelid = '__SCHEMA__.rate_limits'::regclass AND attname = 'purge_at'
      AND NOT attisdropped
  ) THEN
    ALTER TABLE __SCHEMA__.rate_limits ADD COLUMN purge_at bigint NOT NULL DEFAULT 0;
    UPDATE __SCHEMA__.rate_limits SET purge_at = expires_at;
  END IF;
END $migrate$;
ALTER TABLE __SCHEMA__.rate_limits
  ADD COLUMN IF NOT EXISTS recent bigint[] NOT NULL DEFAULT '{}',
  ADD COLUMN IF NOT EXISTS recent_until bigint[] NOT NULL DEFAULT '{}';
ALTER TABLE __SCHEMA__.rate_limits SET (fillfactor = 80);
DROP INDEX IF EXISTS __SCHEMA__.rate_limits_expiry;
CREATE INDEX IF NOT EXISTS rate_limits_purge ON __SCHEMA__.rate_limits (purge_at);

-- The sliding log: one row per admitted attempt (its cost, scored with the store time), deleted
-- with its limit's row, trimmed as it leaves the window.
CREATE __RATE_TABLES__ TABLE IF NOT EXISTS __SCHEMA__.rate_log (
  key text NOT NULL REFERENCES __SCHEMA__.rate_limits (key) ON DELETE CASCADE,
  attempt bigint NOT NULL,
  score bigint NOT NULL,
  cost bigint NOT NULL,
  PRIMARY KEY (key, attempt)
);
CREATE INDEX IF NOT EXISTS rate_log_by_score ON __SCHEMA__.rate_log (key, score);

-- Claims and locks: a holder (a claim's holder id, a lock's token) and an expiry (NULL: kept
-- until deleted).
CREATE TABLE IF NOT EXISTS __SCHEMA__.holds (
  key text PRIMARY KEY,
  holder text NOT NULL,
  expires_at bigint
);
CREATE INDEX IF NOT EXISTS holds_expiry ON __SCHEMA__.holds (expires_at)
  WHERE expires_at IS NOT NULL;

-- Permits of a concurrency limit: one row per holder of one of a key's permits, until its lease
-- ends.
CREATE TABLE IF NOT EXISTS __SCHEMA__.permits (
  key text NOT NULL,
  token text NOT NULL,
  expires_at bigint NOT NULL,
  PRIMARY KEY (key, token)
);
CREATE INDEX IF NOT EXISTS permits_expiry ON __SCHEMA__.permits (expires_at);
-- The queue of waiters for a key's permits: arrival order (`arrived`, then the token), each
-- place kept until `expires_at`.
CREATE TABLE IF NOT EXISTS __SCHEMA__.permit_queue (
  key text NOT NULL,
  token text NOT NULL,
  arrived bigint NOT NULL,
  expires_at bigint NOT NULL,
  PRIMARY KEY (key, token)
);
CREATE INDEX IF NOT EXISTS permit_queue_order ON __SCHEMA__.permit_queue (key, arrived, token);
CREATE INDEX IF NOT EXISTS permit_queue_expiry ON __SCHEMA__.permit_queue (expires_at);

-- Fencing counters: the last token drawn per lock name.
CREATE TABLE IF NOT EXISTS __SCHEMA__.fences (
  key text PRIMARY KEY,
  last bigint NOT NULL,
  expires_at bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS fences_expiry ON __SCHEMA__.fences (expires_at);

-- Release markers: the release call that deleted a claim, lock or idempotency claim, so that
-- the same call re-sent answers "released" again.
CREATE TABLE IF NOT EXISTS __SCHEMA__.releases (
  key text PRIMARY KEY,
  call text NOT NULL,
  expires_at bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS releases_expiry ON __SCHEMA__.releases (expires_at);

-- Idempotency records: running (done = false, owned by token for a lease) or done (the encoded
-- response, kept for the retention; the token stays to recognise a second completion).
CREATE TABLE IF NOT EXISTS __SCHEMA__.idempotency (
  key text PRIMARY KEY,
  done boolean NOT NULL,
  fingerprint text NOT NULL,
  token text NOT NULL,
  response bytea,
  expires_at bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS idempotency_expiry ON __SCHEMA__.idempotency (expires_at);

-- The recent attempts of a row once p_attempt charged it at p_now: those still remembered
-- (until after p_now), at most 7 of them, then p_attempt until p_until_new — as rate.lua keeps
-- them.
CREATE OR REPLACE FUNCTION __SCHEMA__.remember(
  p_ids bigint[], p_until bigint[], p_attempt bigint, p_until_new bigint, p_now bigint,
  OUT o_ids bigint[], OUT o_until bigint[]
) LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
  n int := coalesce(cardinality(p_ids), 0);
  i int := 1;
BEGIN
  WHILE i <= n AND p_until[i] <= p_now LOOP i := i + 1; END LOOP;
  IF n - i + 1 > 7 THEN i := n - 6; END IF;
  o_ids := p_ids[i:n] || p_attempt;
  o_until := p_until[i:n] || p_until_new;
END $$;

-- ---------------------------------------------------------------------------------------------
-- check_rate: one rate check, all limits of a policy at once (mirrors scripts/rate.lua).
--   p_algorithm  1 sliding log, 2 sliding counter, 3 GCRA
--   p_keys, p_quotas, p_windows  per limit its key, quota and window (µs), in configuration
--                order (distinct keys)
--   p_cost       >= 0; 0 only looks
--   p_attempt    the attempt id: a re-sent attempt is admitted again without a second charge
--   p_deadline_us  received at or after it (database clock), the check charges nothing
-- Returns {admitted 0|1, retry_after_us, then per limit remaining, reset_us}, or {-2, 0} when
-- received late.
-- Locks every limit's row in key order (made first if missing), so that checks over
-- overlapping keys cannot deadlock, then reads the clock: concurrent checks of one caller are
-- decided one after the other, each at its own instant.
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION __SCHEMA__.check_rate(
  p_algorithm smallint, p_keys text[], p_quotas bigint[], p_windows bigint[],
  p_cost bigint, p_attempt bigint, p_deadline_us bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  v_locked int;
  v_key text;
  r_a bigint;
  r_b bigint;
  r_c bigint;
  r_recent bigint[];
  r_until bigint[];
  v_ids bigint[];
  v_untils bigint[];
  r_expires bigint;
  v_now bigint;
  q bigint;
  w bigint;
  v_replay boolean := false;
  v_admitted boolean := true;
  v_retry bigint := 0;
  -- GCRA
  tat bigint;
  rem bigint;
  ahead bigint;
  units bigint;
  whole bigint;
  used bigint;
  v_expires bigint;
  -- sliding counter, in doubles as rate_sliding_counter
  dq double precision;
  dw double precision;
  dnow double precision;
  dcost double precision;
  idx double precision;
  el double precision;
  cur double precision;
  prev double precision;
  v_same boolean := false;
  room double precision;
  dwait double precision;
  dused double precision;
  dwhole double precision;
  rst double precision;
  -- sliding log
  v_count bigint;
  v_trimmed bigint;
  v_oldest bigint;
  v_wait bigint;
  v_reset bigint;
BEGIN
  -- late already: not even a placeholder row is made
  IF __SCHEMA__.now_us() >= p_deadline_us THEN RETURN ARRAY[-2, 0]; END IF;
  IF cardinality(p_keys) <> 1 THEN
    LOOP
      INSERT INTO __SCHEMA__.rate_limits (key)
        SELECT k FROM unnest(p_keys) AS k ORDER BY k
        ON CONFLICT DO NOTHING;
      SELECT count(*) INTO v_locked FROM (
        SELECT 1 FROM __SCHEMA__.rate_limits WHERE key = ANY (p_keys) ORDER BY key FOR UPDATE
      ) AS l;
      -- a row deleted (purged, reset) between the two statements is made again
      EXIT WHEN v_locked = cardinality(p_keys);
    END LOOP;
    v_now := __SCHEMA__.now_us();
    IF v_now >= p_deadline_us THEN RETURN ARRAY[-2, 0]; END IF;
    IF p_algorithm = 1 THEN
      RETURN __SCHEMA__.rate_sliding_log(p_keys, p_quotas, p_windows, p_cost, p_attempt, v_now);
    ELSIF p_algorithm = 2 THEN
      RETURN __SCHEMA__.rate_sliding_counter(p_keys, p_quotas, p_windows, p_cost, p_attempt,
        v_now, p_deadline_us);
    END IF;
    RETURN __SCHEMA__.rate_gcra(p_keys, p_quotas, p_windows, p_cost, p_attempt, v_now,
      p_deadline_us);
  END IF;

  -- One limit (the common policy), decided here as rate_sliding_log, rate_sliding_counter or
  -- rate_gcra would decide it: its row is locked by reading it (made first if missing; holding no other row,
  -- this cannot deadlock), and read once.
  v_key := p_keys[1];
  LOOP
    SELECT l.a, l.b, l.c, l.recent, l.recent_until, l.expires_at
      INTO r_a, r_b, r_c, r_recent, r_until, r_expires
      FROM __SCHEMA__.rate_limits AS l WHERE l.key = v_key FOR UPDATE;
    EXIT WHEN FOUND;
    -- missing, or deleted (purged, reset) before it could be locked: made, then locked
    INSERT INTO __SCHEMA__.rate_limits (key) VALUES (v_key) ON CONFLICT DO NOTHING;
  END LOOP;
  v_now := __SCHEMA__.now_us();
  IF v_now >= p_deadline_us THEN RETURN ARRAY[-2, 0]; END IF;
  q := p_quotas[1];
  w := p_windows[1];
  -- an expired row remembers nothing, as an expired Redis key holds nothing
  IF r_expires <= v_now THEN r_recent := '{}'; r_until := '{}'; END IF;

  IF p_algorithm = 1 THEN
    IF r_expires <= v_now THEN
      -- an expired log is gone whole, as its Redis key would be
      DELETE FROM __SCHEMA__.rate_log WHERE key = v_key;
      v_count := 0;
      v_trimmed := r_a;
    ELSE
      -- trimmed as rate_sliding_log trims it; what stays is scored after now - window
      WITH gone AS (
        DELETE FROM __SCHEMA__.rate_log
        WHERE key = v_key AND score <= v_now - w
        RETURNING cost
      ) SELECT coalesce((SELECT sum(cost) FROM gone), 0),
               (SELECT min(l.score) FROM __SCHEMA__.rate_log AS l
                WHERE l.key = v_key AND l.score > v_now - w)
        INTO v_trimmed, v_oldest;
      v_count := greatest(r_a - v_trimmed, 0);
    END IF;
    IF v_count = 0 THEN v_oldest := NULL; END IF;
    IF v_count + p_cost > q THEN
      IF p_cost > 0 AND v_count > 0 AND EXISTS (
        SELECT 1 FROM __SCHEMA__.rate_log WHERE key = v_key AND attempt = p_attempt
      ) THEN
        v_replay := true; -- charged by the first run of this attempt
      ELSE
        v_admitted := false;
        v_wait := w;
        IF p_cost <= q THEN
          -- room appears once the (count + cost - quota) oldest units have left the window
          SELECT l.score + w - v_now INTO v_wait FROM (
            SELECT score, sum(cost) OVER (ORDER BY score, attempt) AS upto
            FROM __SCHEMA__.rate_log WHERE key = v_key
          ) AS l
          WHERE l.upto >= v_count + p_cost - q
          ORDER BY l.upto LIMIT 1;
        END IF;
        v_retry := greatest(0, v_wait);
      END IF;
    END IF;
    v_reset := CASE WHEN v_oldest IS NULL THEN 0 ELSE v_oldest + w - v_now END;
    IF v_admitted AND p_cost > 0 AND NOT v_replay THEN
      INSERT INTO __SCHEMA__.rate_log (key, attempt, score, cost)
        VALUES (v_key, p_attempt, v_now, p_cost)
        ON CONFLICT DO NOTHING;
      IF FOUND THEN
        v_count := v_count + p_cost;
        IF v_oldest IS NULL THEN v_reset := w; END IF;
        v_expires := v_now + ((w + 999) / 1000) * 1000;
        UPDATE __SCHEMA__.rate_limits
          SET a = v_count, expires_at = v_expires,
              purge_at = __SCHEMA__.purge_mark(purge_at, v_expires, w)
          WHERE key = v_key;
        v_trimmed := 0;
      END IF;
    END IF;
    IF v_trimmed > 0 THEN
      UPDATE __SCHEMA__.rate_limits SET a = v_count WHERE key = v_key;
    END IF;
    RETURN ARRAY[CASE WHEN v_admitted THEN 1 ELSE 0 END, v_retry,
      greatest(q - v_count, 0), v_reset];
  END IF;

  IF p_algorithm = 2 THEN
    dq := q;
    dw := w / 1000.0;
    dnow := (v_now / 1000)::double precision;
    dcost := p_cost::double precision;
    idx := floor(dnow / dw);
    el := dnow - idx * dw;
    cur := 0; prev := 0;
    IF r_expires > v_now THEN
      IF r_a = idx THEN
        cur := r_b; prev := r_c; v_same := true;
      ELSIF r_a = idx - 1 THEN
        prev := r_b;
      END IF;
      v_replay := p_attempt = ANY (r_recent);
    END IF;
    IF v_replay THEN
      NULL; -- charged by the first run of this attempt: admitted, nothing charged
    ELSIF (cur + dcost) * dw + prev * (dw - el) > dq * dw THEN
      v_admitted := false;
      room := dq - dcost - cur;
      IF dcost > dq THEN
        dwait := dw;
      ELSIF room >= 0 THEN
        dwait := (dw - el) - room * dw / prev;
      ELSE
        dwait := (dw - el) + dw - (dq - dcost) * dw / cur;
      END IF;
      v_retry := ceil(greatest(dwait, 0) * 1000)::bigint;
    ELSIF p_cost > 0 THEN
      cur := cur + dcost;
      SELECT o_ids, o_until INTO v_ids, v_untils
        FROM __SCHEMA__.remember(r_recent, r_until, p_attempt, p_deadline_us, v_now);
      IF v_same THEN
        UPDATE __SCHEMA__.rate_limits SET b = cur::bigint, recent = v_ids, recent_until = v_untils
          WHERE key = v_key;
      ELSE
        v_expires := (v_now / 1000) * 1000 + ceil(2 * dw - el)::bigint * 1000;
        UPDATE __SCHEMA__.rate_limits
          SET a = idx::bigint, b = cur::bigint, c = prev::bigint, recent = v_ids,
              recent_until = v_untils, expires_at = v_expires,
              purge_at = __SCHEMA__.purge_mark(purge_at, v_expires, w)
          WHERE key = v_key;
      END IF;
    END IF;
    dused := cur + prev * (dw - el) / dw;
    dwhole := ceil(dused - 1e-9);
    rst := 0;
    IF dwhole > 0 AND prev > 0 AND dwhole - 1 - cur >= 0 THEN
      rst := (dw - el) - (dwhole - 1 - cur) * dw / prev;
    ELSIF dwhole > 0 THEN
      rst := (dw - el) + dw - (dwhole - 1) * dw / cur;
    END IF;
    RETURN ARRAY[CASE WHEN v_admitted THEN 1 ELSE 0 END, v_retry,
      greatest(dq - dwhole, 0)::bigint, ceil(rst * 1000)::bigint];
  END IF;

  -- GCRA
  tat := v_now; rem := 0;
  IF r_expires > v_now THEN
    IF r_a >= v_now THEN tat := r_a; rem := r_b; END IF;
    v_replay := p_attempt = ANY (r_recent);
  END IF;
  IF v_replay THEN
    NULL; -- charged by the first run of this attempt: admitted, nothing charged
  ELSIF p_cost > q THEN
    v_admitted := false;
    v_retry := w;
  ELSE
    ahead := (tat - v_now) * q + rem + p_cost * w;
    IF ahead > w * q THEN
      v_admitted := false;
      v_retry := (ahead - w * q + q - 1) / q;
    ELSIF p_cost > 0 THEN
      units := rem + p_cost * w;
      whole := units / q;
      tat := tat + whole;
      rem := units - whole * q;
      v_expires := v_now + ((tat - v_now + 999) / 1000 + 1) * 1000;
      SELECT o_ids, o_until INTO v_ids, v_untils
        FROM __SCHEMA__.remember(r_recent, r_until, p_attempt, p_deadline_us, v_now);
      UPDATE __SCHEMA__.rate_limits
        SET a = tat, b = rem, recent = v_ids, recent_until = v_untils, expires_at = v_expires,
            purge_at = __SCHEMA__.purge_mark(purge_at, v_expires, w)
        WHERE key = v_key;
    END IF;
  END IF;
  ahead := (tat - v_now) * q + rem;
  used := (ahead + w - 1) / w;
  RETURN ARRAY[CASE WHEN v_admitted THEN 1 ELSE 0 END, v_retry,
    greatest(q - used, 0),
    CASE WHEN used > 0 THEN (ahead - (used - 1) * w + q - 1) / q ELSE 0 END];
END $$;

-- A batch of rate checks in one call (version 3): checks that wait for the store at the same
-- moment, each decided by check_rate exactly as alone, in the order of their first key and, for
-- one key, as sent, so that two batches lock the keys they share in the same order (a check's
-- keys share its caller's prefix and sort together). Per check (1-based, as sent): its
-- algorithm, its number of limits, its cost and attempt; p_keys, p_quotas and p_windows hold the
-- checks' limits one after another. Returns, per check in the order decided: its number, the
-- length of its reply, then check_rate's reply.
CREATE OR REPLACE FUNCTION __SCHEMA__.check_rates(
  p_algorithms smallint[], p_counts int[], p_keys text[], p_quotas bigint[],
  p_windows bigint[], p_costs bigint[], p_attempts bigint[], p_deadline_us bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  v_first int[] := '{}';
  v_at int := 1;
  v_out bigint[] := '{}';
  v_reply bigint[];
  v_last int;
  c int;
BEGIN
  FOR c IN 1 .. coalesce(array_length(p_algorithms, 1), 0) LOOP
    v_first := v_first || v_at;
    v_at := v_at + p_counts[c];
  END LOOP;
  FOR c IN
    SELECT i FROM generate_subscripts(p_algorithms, 1) AS i ORDER BY p_keys[v_first[i]], i
  LOOP
    v_last := v_first[c] + p_counts[c] - 1;
    v_reply := __SCHEMA__.check_rate(p_algorithms[c], p_keys[v_first[c]:v_last],
      p_quotas[v_first[c]:v_last], p_windows[v_first[c]:v_last], p_costs[c], p_attempts[c],
      p_deadline_us);
    v_out := v_out || ARRAY[c, cardinality(v_reply)]::bigint[] || v_reply;
  END LOOP;
  RETURN v_out;
END $$;

-- Sliding log: exact. The oldest rows leave the window first; a check trims what left it.
-- Cost: O(trimmed) plus index look-ups; a denial adds one scan of its log for the wait.
CREATE OR REPLACE FUNCTION __SCHEMA__.rate_sliding_log(
  p_keys text[], p_quotas bigint[], p_windows bigint[], p_cost bigint, p_attempt bigint,
  p_now bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  n int := cardinality(p_keys);
  v_counts bigint[] := '{}';
  v_oldests bigint[] := '{}';
  v_admitted boolean := true;
  v_replay boolean := false;
  v_retry bigint := 0;
  v_out bigint[];
  v_row __SCHEMA__.rate_limits;
  v_count bigint;
  v_oldest bigint;
  v_trimmed bigint;
  v_wait bigint;
  v_reset bigint;
BEGIN
  FOR i IN 1..n LOOP
    SELECT * INTO v_row FROM __SCHEMA__.rate_limits WHERE key = p_keys[i];
    IF v_row.expires_at <= p_now THEN
      -- an expired log is gone whole, as its Redis key would be
      DELETE FROM __SCHEMA__.rate_log WHERE key = p_keys[i];
      v_count := 0;
      v_trimmed := v_row.a;
    ELSE
      -- a row scored s covers (s - window, s]; it is gone once now - window >= s
      WITH gone AS (
        DELETE FROM __SCHEMA__.rate_log
        WHERE key = p_keys[i] AND score <= p_now - p_windows[i]
        RETURNING cost
      ) SELECT coalesce(sum(cost), 0) INTO v_trimmed FROM gone;
      v_count := greatest(v_row.a - v_trimmed, 0);
    END IF;
    IF v_trimmed > 0 THEN
      UPDATE __SCHEMA__.rate_limits SET a = v_count WHERE key = p_keys[i];
    END IF;
    v_oldest := NULL;
    IF v_count > 0 THEN
      SELECT min(score) INTO v_oldest FROM __SCHEMA__.rate_log WHERE key = p_keys[i];
    END IF;
    v_counts[i] := v_count;
    v_oldests[i] := v_oldest;
    IF NOT v_replay AND v_count + p_cost > p_quotas[i] THEN
      IF p_cost > 0 AND v_count > 0 AND EXISTS (
        SELECT 1 FROM __SCHEMA__.rate_log WHERE key = p_keys[i] AND attempt = p_attempt
      ) THEN
        -- charged by the first run of this attempt
        v_replay := true;
      ELSE
        v_admitted := false;
        v_wait := p_windows[i];
        IF p_cost <= p_quotas[i] THEN
          -- room appears once the (count + cost - quota) oldest units have left the window
          SELECT l.score + p_windows[i] - p_now INTO v_wait FROM (
            SELECT score, sum(cost) OVER (ORDER BY score, attempt) AS upto
            FROM __SCHEMA__.rate_log WHERE key = p_keys[i]
          ) AS l
          WHERE l.upto >= v_count + p_cost - p_quotas[i]
          ORDER BY l.upto LIMIT 1;
        END IF;
        v_retry := greatest(v_retry, v_wait);
      END IF;
    END IF;
  END LOOP;
  IF v_replay THEN
    v_admitted := true;
    v_retry := 0;
  END IF;
  v_out := ARRAY[CASE WHEN v_admitted THEN 1 ELSE 0 END, v_retry];
  FOR i IN 1..n LOOP
    v_count := v_counts[i];
    v_reset := CASE WHEN v_oldests[i] IS NULL THEN 0 ELSE v_oldests[i] + p_windows[i] - p_now END;
    IF v_admitted AND p_cost > 0 THEN
      INSERT INTO __SCHEMA__.rate_log (key, attempt, score, cost)
        VALUES (p_keys[i], p_attempt, p_now, p_cost)
        ON CONFLICT DO NOTHING;
      IF FOUND THEN
        v_count := v_count + p_cost;
        -- the log was empty: its oldest entry is this request's
        IF v_oldests[i] IS NULL THEN v_reset := p_windows[i]; END IF;
        UPDATE __SCHEMA__.rate_limits
          SET a = v_count,
              expires_at = p_now + __SCHEMA__.ceil_div(p_windows[i], 1000) * 1000,
              purge_at = __SCHEMA__.purge_mark(purge_at,
                p_now + __SCHEMA__.ceil_div(p_windows[i], 1000) * 1000, p_windows[i])
          WHERE key = p_keys[i];
      END IF;
    END IF;
    v_out := v_out || ARRAY[greatest(p_quotas[i] - v_count, 0), v_reset];
  END LOOP;
  RETURN v_out;
END $$;

-- Sliding-window counter: O(1) per limit, in milliseconds of store time and in doubles, as the
-- Lua script computes it: current + previous * (share of the previous window still inside the
-- sliding one).
CREATE OR REPLACE FUNCTION __SCHEMA__.rate_sliding_counter(
  p_keys text[], p_quotas bigint[], p_windows bigint[], p_cost bigint, p_attempt bigint,
  p_now bigint, p_deadline bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  n int := cardinality(p_keys);
  v_now double precision := (p_now / 1000)::double precision;
  v_cost double precision := p_cost::double precision;
  v_indexes double precision[] := '{}';
  v_elapsed double precision[] := '{}';
  v_curs double precision[] := '{}';
  v_prevs double precision[] := '{}';
  v_sames boolean[] := '{}';
  v_admitted boolean := true;
  v_replay boolean := false;
  v_retry double precision := 0;
  v_out bigint[];
  v_row __SCHEMA__.rate_limits;
  -- the first limit's recent attempts, and what they become
  v_recent bigint[] := '{}';
  v_until bigint[] := '{}';
  v_ids bigint[];
  v_untils bigint[];
  q double precision;
  w double precision;
  idx double precision;
  el double precision;
  cur double precision;
  prev double precision;
  v_same boolean;
  room double precision;
  wait double precision;
  used double precision;
  whole double precision;
  rst double precision;
BEGIN
  FOR i IN 1..n LOOP
    q := p_quotas[i];
    w := p_windows[i] / 1000.0;
    idx := floor(v_now / w);
    el := v_now - idx * w;
    cur := 0; prev := 0; v_same := false;
    SELECT * INTO v_row FROM __SCHEMA__.rate_limits WHERE key = p_keys[i];
    IF v_row.expires_at > p_now THEN
      IF v_row.a = idx THEN
        cur := v_row.b; prev := v_row.c; v_same := true;
      ELSIF v_row.a = idx - 1 THEN
        prev := v_row.b;
      END IF;
      IF i = 1 THEN
        v_recent := v_row.recent; v_until := v_row.recent_until;
        v_replay := p_attempt = ANY (v_recent);
      END IF;
    END IF;
    v_indexes[i] := idx; v_elapsed[i] := el; v_curs[i] := cur; v_prevs[i] := prev;
    v_sames[i] := v_same;
    IF v_replay THEN
      NULL; -- charged by the first run of this attempt: nothing to decide
    ELSIF (cur + v_cost) * w + prev * (w - el) > q * w THEN
      v_admitted := false;
      room := q - v_cost - cur;
      IF v_cost > q THEN
        wait := w;
      ELSIF room >= 0 THEN
        -- prev > 0 here: the previous window's share is what denies
        wait := (w - el) - room * w / prev;
      ELSE
        -- cur > 0 here: next window, where cur becomes the previous one
        wait := (w - el) + w - (q - v_cost) * w / cur;
      END IF;
      v_retry := greatest(v_retry, wait);
    END IF;
  END LOOP;
  IF v_replay THEN
    v_admitted := true;
    v_retry := 0;
  END IF;
  v_out := ARRAY[CASE WHEN v_admitted THEN 1 ELSE 0 END, ceil(v_retry * 1000)::bigint];
  FOR i IN 1..n LOOP
    q := p_quotas[i];
    w := p_windows[i] / 1000.0;
    idx := v_indexes[i]; el := v_elapsed[i]; cur := v_curs[i]; prev := v_prevs[i];
    IF v_admitted AND NOT v_replay AND p_cost > 0 THEN
      cur := cur + v_cost;
      v_ids := '{}'; v_untils := '{}';
      IF i = 1 THEN
        SELECT o_ids, o_until INTO v_ids, v_untils
          FROM __SCHEMA__.remember(v_recent, v_until, p_attempt, p_deadline, p_now);
      END IF;
      IF v_sames[i] THEN
        -- the same window: its expiry (the end of the next window) stands
        UPDATE __SCHEMA__.rate_limits SET b = cur::bigint, recent = v_ids, recent_until = v_untils
          WHERE key = p_keys[i];
      ELSE
        UPDATE __SCHEMA__.rate_limits
          SET a = idx::bigint, b = cur::bigint, c = prev::bigint, recent = v_ids,
              recent_until = v_untils,
              expires_at = (p_now / 1000) * 1000 + ceil(2 * w - el)::bigint * 1000,
              purge_at = __SCHEMA__.purge_mark(purge_at,
                (p_now / 1000) * 1000 + ceil(2 * w - el)::bigint * 1000, p_windows[i])
          WHERE key = p_keys[i];
      END IF;
    END IF;
    used := cur + prev * (w - el) / w;
    whole := ceil(used - 1e-9);
    rst := 0;
    -- the quota grows when the estimate next drops below a whole unit
    IF whole > 0 AND prev > 0 AND whole - 1 - cur >= 0 THEN
      rst := (w - el) - (whole - 1 - cur) * w / prev;
    ELSIF whole > 0 THEN
      rst := (w - el) + w - (whole - 1) * w / cur;
    END IF;
    v_out := v_out || ARRAY[greatest(q - whole, 0)::bigint, ceil(rst * 1000)::bigint];
  END LOOP;
  RETURN v_out;
END $$;

-- GCRA: O(1) per limit, exact in integers. Emission interval T = window / quota; offsets from
-- now are counted in 1/quota microseconds, where T is exactly `window` units.
CREATE OR REPLACE FUNCTION __SCHEMA__.rate_gcra(
  p_keys text[], p_quotas bigint[], p_windows bigint[], p_cost bigint, p_attempt bigint,
  p_now bigint, p_deadline bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  n int := cardinality(p_keys);
  v_tats bigint[] := '{}';
  v_rems bigint[] := '{}';
  v_admitted boolean := true;
  v_replay boolean := false;
  v_retry bigint := 0;
  v_out bigint[];
  v_row __SCHEMA__.rate_limits;
  -- the first limit's recent attempts, and what they become
  v_recent bigint[] := '{}';
  v_until bigint[] := '{}';
  v_ids bigint[];
  v_untils bigint[];
  q bigint;
  w bigint;
  tat bigint;
  rem bigint;
  ahead bigint;
  units bigint;
  whole bigint;
  used bigint;
BEGIN
  FOR i IN 1..n LOOP
    q := p_quotas[i];
    w := p_windows[i];
    tat := p_now; rem := 0;
    SELECT * INTO v_row FROM __SCHEMA__.rate_limits WHERE key = p_keys[i];
    IF v_row.expires_at > p_now THEN
      IF v_row.a >= p_now THEN tat := v_row.a; rem := v_row.b; END IF;
      IF i = 1 THEN
        v_recent := v_row.recent; v_until := v_row.recent_until;
        v_replay := p_attempt = ANY (v_recent);
      END IF;
    END IF;
    v_tats[i] := tat; v_rems[i] := rem;
    IF v_replay THEN
      NULL; -- charged by the first run of this attempt: nothing to decide
    ELSIF p_cost > q THEN
      v_admitted := false;
      v_retry := greatest(v_retry, w);
    ELSE
      ahead := (tat - p_now) * q + rem + p_cost * w;
      IF ahead > w * q THEN
        v_admitted := false;
        v_retry := greatest(v_retry, __SCHEMA__.ceil_div(ahead - w * q, q));
      END IF;
    END IF;
  END LOOP;
  IF v_replay THEN
    v_admitted := true;
    v_retry := 0;
  END IF;
  v_out := ARRAY[CASE WHEN v_admitted THEN 1 ELSE 0 END, v_retry];
  FOR i IN 1..n LOOP
    q := p_quotas[i];
    w := p_windows[i];
    tat := v_tats[i]; rem := v_rems[i];
    IF v_admitted AND NOT v_replay AND p_cost > 0 THEN
      units := rem + p_cost * w;
      whole := units / q;
      tat := tat + whole;
      rem := units - whole * q;
      v_ids := '{}'; v_untils := '{}';
      IF i = 1 THEN
        SELECT o_ids, o_until INTO v_ids, v_untils
          FROM __SCHEMA__.remember(v_recent, v_until, p_attempt, p_deadline, p_now);
      END IF;
      UPDATE __SCHEMA__.rate_limits
        SET a = tat, b = rem, recent = v_ids, recent_until = v_untils,
            expires_at = p_now + (__SCHEMA__.ceil_div(tat - p_now, 1000) + 1) * 1000,
            purge_at = __SCHEMA__.purge_mark(purge_at,
              p_now + (__SCHEMA__.ceil_div(tat - p_now, 1000) + 1) * 1000, w)
        WHERE key = p_keys[i];
    END IF;
    ahead := (tat - p_now) * q + rem;
    used := __SCHEMA__.ceil_div(ahead, w);
    v_out := v_out || ARRAY[
      greatest(q - used, 0),
      CASE WHEN used > 0 THEN __SCHEMA__.ceil_div(ahead - (used - 1) * w, q) ELSE 0 END
    ];
  END LOOP;
  RETURN v_out;
END $$;

-- reset_rate: deletes a caller's limits (and their logs), locking them in key order as
-- check_rate does.
CREATE OR REPLACE FUNCTION __SCHEMA__.reset_rate(p_keys text[]) RETURNS void
LANGUAGE sql AS $$
  DELETE FROM __SCHEMA__.rate_limits WHERE key IN (
    SELECT key FROM __SCHEMA__.rate_limits WHERE key = ANY (p_keys) ORDER BY key FOR UPDATE
  )
$$;

-- ---------------------------------------------------------------------------------------------
-- claim: the holder is stored only if the key is free (absent or expired); the loser learns
-- the holder in the same step. The same holder again wins again. (as claim.lua)
-- p_ttl_ms 0: kept until deleted. Returns (tag, holder): 1 this call claimed the key, 2 this
-- holder held it already, 0 another holds it; -1 received at or after p_deadline_us, nothing
-- done.
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION __SCHEMA__.claim(
  p_key text, p_holder text, p_ttl_ms bigint, p_deadline_us bigint,
  OUT o_tag smallint, OUT o_holder text
) LANGUAGE plpgsql AS $$
DECLARE
  v_holder text;
  v_expires bigint;
  v_found boolean;
  v_now bigint;
BEGIN
  -- Why the key's lock: a caller undoes an unanswered claim (release_hold) only once its
  -- deadline has passed. A claim that read the clock before its deadline may still be running
  -- then, its INSERT not committed — and a DELETE neither sees nor waits for an uncommitted
  -- INSERT, so the undo would miss it and the claim would stay. Every write and release of the
  -- key takes this lock first: the undo waits until the claim's transaction has ended, then
  -- reads what it committed. Held by whoever came first, it also makes the read below final.
  PERFORM __SCHEMA__.lock_key(p_key);
  SELECT holder, expires_at INTO v_holder, v_expires
    FROM __SCHEMA__.holds WHERE key = p_key FOR UPDATE;
  v_found := FOUND;
  v_now := __SCHEMA__.now_us();
  IF v_now >= p_deadline_us THEN
    o_tag := -1;
    RETURN;
  END IF;
  IF v_found AND (v_expires IS NULL OR v_expires > v_now) THEN
    o_tag := CASE WHEN v_holder = p_holder THEN 2 ELSE 0 END;
    o_holder := v_holder;
    RETURN;
  END IF;
  -- absent, or expired: free, as if absent
  INSERT INTO __SCHEMA__.holds (key, holder, expires_at)
    VALUES (p_key, p_holder, CASE WHEN p_ttl_ms > 0 THEN v_now + p_ttl_ms * 1000 END)
    ON CONFLICT (key) DO UPDATE SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at;
  o_tag := 1;
  o_holder := p_holder;
END $$;

-- ---------------------------------------------------------------------------------------------
-- lock_acquire: sets the lock to p_token for the lease if it is free and only then draws the
-- next fencing token, above both the counter's last value and the store time in µs. The same
-- token again is acquired again with the same fencing token and a fresh lease.
-- (as lock_acquire.lua) Returns (1, fence) acquired, (0, lease_left_ms; -1 when it never
-- expires) held by another, or (-1, NULL) received at or after p_deadline_us, nothing done.
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION __SCHEMA__.lock_acquire(
  p_key text, p_fence_key text, p_token text, p_lease_ms bigint, p_fence_ttl_ms bigint,
  p_deadline_us bigint, OUT o_tag smallint, OUT o_value bigint
) LANGUAGE plpgsql AS $$
DECLARE
  v_holder text;
  v_expires bigint;
  v_found boolean;
  v_now bigint;
  v_drawn bigint;
BEGIN
  -- serialised with the release of this key: see claim. The fencing counter of the lock is
  -- written only under this lock too.
  PERFORM __SCHEMA__.lock_key(p_key);
  SELECT holder, expires_at INTO v_holder, v_expires
    FROM __SCHEMA__.holds WHERE key = p_key FOR UPDATE;
  v_found := FOUND;
  v_now := __SCHEMA__.now_us();
  IF v_now >= p_deadline_us THEN
    o_tag := -1;
    RETURN;
  END IF;
  IF v_found AND (v_expires IS NULL OR v_expires > v_now) THEN
    IF v_holder <> p_token THEN
      o_tag := 0;
      o_value := CASE WHEN v_expires IS NULL THEN -1 ELSE (v_expires - v_now) / 1000 END;
      RETURN;
    END IF;
    SELECT last INTO v_drawn FROM __SCHEMA__.fences
      WHERE key = p_fence_key AND expires_at > v_now;
    IF FOUND THEN
      -- the same attempt again: acquired already, with the fence it drew
      UPDATE __SCHEMA__.holds SET expires_at = v_now + p_lease_ms * 1000 WHERE key = p_key;
      o_tag := 1;
      o_value := v_drawn;
      RETURN;
    END IF;
  END IF;
  INSERT INTO __SCHEMA__.holds (key, holder, expires_at)
    VALUES (p_key, p_token, v_now + p_lease_ms * 1000)
    ON CONFLICT (key) DO UPDATE SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at;
  INSERT INTO __SCHEMA__.fences AS f (key, last, expires_at)
    VALUES (p_fence_key, v_now, v_now + p_fence_ttl_ms * 1000)
    ON CONFLICT (key) DO UPDATE
      SET last = CASE WHEN f.expires_at > v_now AND f.last >= v_now THEN f.last + 1
                      ELSE v_now END,
          expires_at = EXCLUDED.expires_at
    RETURNING last INTO o_value;
  o_tag := 1;
END $$;

-- extend_hold: resets a claim's or lock's expiry to p_lease_ms from now, only while it holds
-- p_token: 1, else 0; -1 received at or after p_deadline_us, nothing done.
-- (as compare_and_pexpire.lua) It only updates a row that exists: the row's lock serialises it
-- with a release, which needs no advisory lock for that.
CREATE OR REPLACE FUNCTION __SCHEMA__.extend_hold(
  p_key text, p_token text, p_lease_ms bigint, p_deadline_us bigint
) RETURNS smallint LANGUAGE plpgsql AS $$
DECLARE
  v_holder text;
  v_expires bigint;
  v_found boolean;
  v_now bigint;
BEGIN
  SELECT holder, expires_at INTO v_holder, v_expires
    FROM __SCHEMA__.holds WHERE key = p_key FOR UPDATE;
  v_found := FOUND;
  v_now := __SCHEMA__.now_us();
  IF v_now >= p_deadline_us THEN RETURN -1; END IF;
  IF NOT v_found OR v_holder <> p_token OR v_expires <= v_now THEN RETURN 0; END IF;
  UPDATE __SCHEMA__.holds SET expires_at = v_now + p_lease_ms * 1000 WHERE key = p_key;
  RETURN 1;
END $$;

-- release_hold: deletes a claim or lock only while it holds p_token, leaving a marker naming
-- this release call (p_call), so that the call re-sent answers true again.
-- (as compare_and_delete.lua)
CREATE OR REPLACE FUNCTION __SCHEMA__.release_hold(
  p_key text, p_token text, p_call text, p_marker_ms bigint
) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
  v_holder text;
  v_expires bigint;
  v_found boolean;
  v_now bigint;
BEGIN
  -- after every write of this key still running, and seeing what it committed: see claim
  PERFORM __SCHEMA__.lock_key(p_key);
  SELECT holder, expires_at INTO v_holder, v_expires
    FROM __SCHEMA__.holds WHERE key = p_key FOR UPDATE;
  v_found := FOUND;
  v_now := __SCHEMA__.now_us();
  IF v_found AND v_holder = p_token AND (v_expires IS NULL OR v_expires > v_now) THEN
    DELETE FROM __SCHEMA__.holds WHERE key = p_key;
    PERFORM __SCHEMA__.mark_release(p_key, p_call, v_now + p_marker_ms * 1000);
    RETURN true;
  END IF;
  RETURN __SCHEMA__.released_by(p_key, p_call, v_now);
END $$;

CREATE OR REPLACE FUNCTION __SCHEMA__.mark_release(p_key text, p_call text, p_expires bigint)
RETURNS void LANGUAGE sql AS $$
  INSERT INTO __SCHEMA__.releases (key, call, expires_at) VALUES (p_key, p_call, p_expires)
    ON CONFLICT (key) DO UPDATE SET call = EXCLUDED.call, expires_at = EXCLUDED.expires_at
$$;

CREATE OR REPLACE FUNCTION __SCHEMA__.released_by(p_key text, p_call text, p_now bigint)
RETURNS boolean LANGUAGE sql AS $$
  SELECT EXISTS (
    SELECT 1 FROM __SCHEMA__.releases
    WHERE key = p_key AND call = p_call AND expires_at > p_now
  )
$$;

-- ---------------------------------------------------------------------------------------------
-- Permits (as permit_*.lua): at most p_limit unexpired rows per key in `permits`; waiters queue
-- in `permit_queue`, and a permit is free for a holder while fewer waiters arrived before it than
-- permits are free (one that does not queue counts every waiter as before it).
-- permit_acquire takes one for p_token if one is free for it and only then draws the next
-- fencing token, as lock_acquire does; else, with p_wait_ms > 0, it keeps the token's place in
-- the queue for p_wait_ms. A token that holds one already keeps it, with a fresh lease and a
-- fresh fencing token. Returns (1, fence, NULL) taken by this call, (2, fence, NULL) held by this
-- token already, (0, ms until the first lease ends or 0, waiters ahead) none free for it, or
-- (-1, NULL, NULL) received at or after p_deadline_us, nothing done.
-- ---------------------------------------------------------------------------------------------
DROP FUNCTION IF EXISTS __SCHEMA__.permit_acquire(text, text, text, bigint, bigint, bigint, bigint);
CREATE OR REPLACE FUNCTION __SCHEMA__.permit_acquire(
  p_key text, p_fence_key text, p_token text, p_limit bigint, p_lease_ms bigint,
  p_fence_ttl_ms bigint, p_wait_ms bigint, p_deadline_us bigint,
  OUT o_tag smallint, OUT o_value bigint, OUT o_ahead bigint
) LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint;
  v_held bigint;
  v_mine boolean;
  v_first bigint;
  v_arrived bigint;
BEGIN
  -- serialised with every acquisition and release of the key (see claim): the count is final
  PERFORM __SCHEMA__.lock_key(p_key);
  v_now := __SCHEMA__.now_us();
  IF v_now >= p_deadline_us THEN
    o_tag := -1;
    RETURN;
  END IF;
  -- leases that ended give their permits back; places that lapsed leave the queue
  DELETE FROM __SCHEMA__.permits WHERE key = p_key AND expires_at <= v_now;
  DELETE FROM __SCHEMA__.permit_queue WHERE key = p_key AND expires_at <= v_now;
  SELECT count(*), coalesce(bool_or(token = p_token), false), min(expires_at)
    INTO v_held, v_mine, v_first
    FROM __SCHEMA__.permits WHERE key = p_key;
  IF NOT v_mine THEN
    SELECT arrived INTO v_arrived FROM __SCHEMA__.permit_queue
      WHERE key = p_key AND token = p_token;
    SELECT count(*) INTO o_ahead FROM __SCHEMA__.permit_queue
      WHERE key = p_key AND (v_arrived IS NULL OR (arrived, token) < (v_arrived, p_token));
    IF o_ahead >= p_limit - v_held THEN
      IF p_wait_ms > 0 THEN
        INSERT INTO __SCHEMA__.permit_queue (key, token, arrived, expires_at)
          VALUES (p_key, p_token, v_now, v_now + p_wait_ms * 1000)
          ON CONFLICT (key, token) DO UPDATE SET expires_at = EXCLUDED.expires_at;
      END IF;
      o_tag := 0;
      o_value := CASE WHEN v_first IS NULL THEN 0
                      ELSE __SCHEMA__.ceil_div(v_first - v_now, 1000) END;
      RETURN;
    END IF;
    DELETE FROM __SCHEMA__.permit_queue WHERE key = p_key AND token = p_token;
  END IF;
  o_ahead := NULL;
  INSERT INTO __SCHEMA__.permits (key, token, expires_at)
    VALUES (p_key, p_token, v_now + p_lease_ms * 1000)
    ON CONFLICT (key, token) DO UPDATE SET expires_at = EXCLUDED.expires_at;
  INSERT INTO __SCHEMA__.fences AS f (key, last, expires_at)
    VALUES (p_fence_key, v_now, v_now + p_fence_ttl_ms * 1000)
    ON CONFLICT (key) DO UPDATE
      SET last = CASE WHEN f.expires_at > v_now AND f.last >= v_now THEN f.last + 1
                      ELSE v_now END,
          expires_at = EXCLUDED.expires_at
    RETURNING last INTO o_value;
  o_tag := CASE WHEN v_mine THEN 2 ELSE 1 END;
END $$;

-- permit_extend: resets p_token's permit to p_lease_ms from now while it holds an unexpired
-- one: 1, else 0; -1 received at or after p_deadline_us, nothing done. (as permit_extend.lua)
-- Like extend_hold, the row's lock serialises it with a release.
CREATE OR REPLACE FUNCTION __SCHEMA__.permit_extend(
  p_key text, p_token text, p_lease_ms bigint, p_deadline_us bigint
) RETURNS smallint LANGUAGE plpgsql AS $$
DECLARE
  v_expires bigint;
  v_found boolean;
  v_now bigint;
BEGIN
  SELECT expires_at INTO v_expires
    FROM __SCHEMA__.permits WHERE key = p_key AND token = p_token FOR UPDATE;
  v_found := FOUND;
  v_now := __SCHEMA__.now_us();
  IF v_now >= p_deadline_us THEN RETURN -1; END IF;
  IF NOT v_found OR v_expires <= v_now THEN RETURN 0; END IF;
  UPDATE __SCHEMA__.permits SET expires_at = v_now + p_lease_ms * 1000
    WHERE key = p_key AND token = p_token;
  RETURN 1;
END $$;

-- permit_release: gives p_token's permit back while it holds an unexpired one (and its place in
-- the queue, if it waits), leaving a marker
-- naming this release call (p_call) under `<key> <token>`, so that the call re-sent answers
-- true again. (as permit_release.lua)
CREATE OR REPLACE FUNCTION __SCHEMA__.permit_release(
  p_key text, p_token text, p_call text, p_marker_ms bigint
) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
  v_expires bigint;
  v_now bigint;
BEGIN
  -- after every acquisition of this key still running, and seeing what it committed: see claim
  PERFORM __SCHEMA__.lock_key(p_key);
  v_now := __SCHEMA__.now_us();
  DELETE FROM __SCHEMA__.permit_queue WHERE key = p_key AND token = p_token;
  DELETE FROM __SCHEMA__.permits WHERE key = p_key AND token = p_token
    RETURNING expires_at INTO v_expires;
  IF FOUND AND v_expires > v_now THEN
    PERFORM __SCHEMA__.mark_release(p_key || ' ' || p_token, p_call, v_now + p_marker_ms * 1000);
    RETURN true;
  END IF;
  RETURN __SCHEMA__.released_by(p_key || ' ' || p_token, p_call, v_now);
END $$;

-- ---------------------------------------------------------------------------------------------
-- Idempotency records (as idem_*.lua).
-- idem_begin returns (tag, lease_left_ms, response): 0 claimed for this request; 1 another
-- request with this key runs; 2 the key was used with another fingerprint; 3 completed; -1
-- received at or after p_deadline_us, nothing done.
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION __SCHEMA__.idem_begin(
  p_key text, p_fingerprint text, p_token text, p_lease_ms bigint, p_deadline_us bigint,
  OUT o_tag smallint, OUT o_lease_left bigint, OUT o_response bytea
) LANGUAGE plpgsql AS $$
DECLARE
  v_row __SCHEMA__.idempotency;
  v_found boolean;
  v_now bigint;
BEGIN
  -- serialised with the release of this key, as a claim is: see claim
  PERFORM __SCHEMA__.lock_key(p_key);
  SELECT * INTO v_row FROM __SCHEMA__.idempotency WHERE key = p_key FOR UPDATE;
  v_found := FOUND;
  v_now := __SCHEMA__.now_us();
  IF v_now >= p_deadline_us THEN
    o_tag := -1;
  ELSIF NOT v_found OR v_row.expires_at <= v_now THEN
    INSERT INTO __SCHEMA__.idempotency (key, done, fingerprint, token, response, expires_at)
      VALUES (p_key, false, p_fingerprint, p_token, NULL, v_now + p_lease_ms * 1000)
      ON CONFLICT (key) DO UPDATE
        SET done = false, fingerprint = EXCLUDED.fingerprint, token = EXCLUDED.token,
            response = NULL, expires_at = EXCLUDED.expires_at;
    o_tag := 0;
  ELSIF v_row.fingerprint <> p_fingerprint THEN
    o_tag := 2;
  ELSIF v_row.done THEN
    o_tag := 3; o_response := v_row.response;
  ELSIF v_row.token = p_token THEN
    -- the same attempt again: claimed again, its lease reset
    UPDATE __SCHEMA__.idempotency SET expires_at = v_now + p_lease_ms * 1000
      WHERE key = p_key;
    o_tag := 0;
  ELSE
    o_tag := 1; o_lease_left := (v_row.expires_at - v_now) / 1000;
  END IF;
END $$;

-- idem_complete: stores the response only while p_token owns the running claim; a record this
-- token completed with this very response answers 1 again. 1 stored, 0 not; -1 received at or
-- after p_deadline_us, nothing done. It updates only a row that exists, under its row lock.
CREATE OR REPLACE FUNCTION __SCHEMA__.idem_complete(
  p_key text, p_token text, p_response bytea, p_retention_ms bigint, p_deadline_us bigint
) RETURNS smallint LANGUAGE plpgsql AS $$
DECLARE
  v_row __SCHEMA__.idempotency;
  v_found boolean;
  v_now bigint;
BEGIN
  SELECT * INTO v_row FROM __SCHEMA__.idempotency WHERE key = p_key FOR UPDATE;
  v_found := FOUND;
  v_now := __SCHEMA__.now_us();
  IF v_now >= p_deadline_us THEN RETURN -1; END IF;
  IF NOT v_found OR v_row.token <> p_token OR v_row.expires_at <= v_now THEN RETURN 0; END IF;
  IF v_row.done THEN
    RETURN CASE WHEN v_row.response = p_response THEN 1 ELSE 0 END;
  END IF;
  UPDATE __SCHEMA__.idempotency
    SET done = true, response = p_response, expires_at = v_now + p_retention_ms * 1000
    WHERE key = p_key;
  RETURN 1;
END $$;

-- idem_release: deletes a running claim p_token owns, with a release marker as release_hold.
CREATE OR REPLACE FUNCTION __SCHEMA__.idem_release(
  p_key text, p_token text, p_call text, p_marker_ms bigint
) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
  v_row __SCHEMA__.idempotency;
  v_found boolean;
  v_now bigint;
BEGIN
  -- after every write of this key still running, and seeing what it committed: see claim
  PERFORM __SCHEMA__.lock_key(p_key);
  SELECT * INTO v_row FROM __SCHEMA__.idempotency WHERE key = p_key FOR UPDATE;
  v_found := FOUND;
  v_now := __SCHEMA__.now_us();
  IF v_found AND NOT v_row.done AND v_row.token = p_token AND v_row.expires_at > v_now THEN
    DELETE FROM __SCHEMA__.idempotency WHERE key = p_key;
    PERFORM __SCHEMA__.mark_release(p_key, p_call, v_now + p_marker_ms * 1000);
    RETURN true;
  END IF;
  RETURN __SCHEMA__.released_by(p_key, p_call, v_now);
END $$;

-- idem_extend: extends a running claim p_token owns to p_lease_ms from now: 1, else 0; -1
-- received at or after p_deadline_us, nothing done.
CREATE OR REPLACE FUNCTION __SCHEMA__.idem_extend(
  p_key text, p_token text, p_lease_ms bigint, p_deadline_us bigint
) RETURNS smallint LANGUAGE plpgsql AS $$
DECLARE
  v_row __SCHEMA__.idempotency;
  v_found boolean;
  v_now bigint;
BEGIN
  SELECT * INTO v_row FROM __SCHEMA__.idempotency WHERE key = p_key FOR UPDATE;
  v_found := FOUND;
  v_now := __SCHEMA__.now_us();
  IF v_now >= p_deadline_us THEN RETURN -1; END IF;
  IF NOT v_found OR v_row.done OR v_row.token <> p_token OR v_row.expires_at <= v_now THEN
    RETURN 0;
  END IF;
  UPDATE __SCHEMA__.idempotency SET expires_at = v_now + p_lease_ms * 1000 WHERE key = p_key;
  RETURN 1;
END $$;

-- ---------------------------------------------------------------------------------------------
-- purge_expired: deletes at most p_limit expired rows of each table, found through the expiry
-- indexes (rate_limits: its purge mark, never before the expiry; a sliding log's rows go with
-- their limit's row), table after table in the lock order (see the header). Rows locked by a
-- running operation are skipped, so that a purge never waits for a check, nor makes one wait in a cycle.
-- Returns the most rows deleted from one table (the caller runs it again while that equals
-- p_limit) and the rows deleted in all. Cost: O(rows deleted).
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION __SCHEMA__.purge_expired(
  p_limit integer, OUT o_most integer, OUT o_total bigint
) LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := __SCHEMA__.now_us();
  v_count integer;
BEGIN
  o_most := 0;
  o_total := 0;
  DELETE FROM __SCHEMA__.rate_limits WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM __SCHEMA__.rate_limits WHERE purge_at <= v_now
    LIMIT p_limit FOR UPDATE SKIP LOCKED
  ));
  GET DIAGNOSTICS v_count = ROW_COUNT;
  o_most := greatest(o_most, v_count); o_total := o_total + v_count;
  DELETE FROM __SCHEMA__.holds WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM __SCHEMA__.holds WHERE expires_at <= v_now
    LIMIT p_limit FOR UPDATE SKIP LOCKED
  ));
  GET DIAGNOSTICS v_count = ROW_COUNT;
  o_most := greatest(o_most, v_count); o_total := o_total + v_count;
  DELETE FROM __SCHEMA__.permits WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM __SCHEMA__.permits WHERE expires_at <= v_now
    LIMIT p_limit FOR UPDATE SKIP LOCKED
  ));
  GET DIAGNOSTICS v_count = ROW_COUNT;
  o_most := greatest(o_most, v_count); o_total := o_total + v_count;
  DELETE FROM __SCHEMA__.permit_queue WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM __SCHEMA__.permit_queue WHERE expires_at <= v_now
    LIMIT p_limit FOR UPDATE SKIP LOCKED
  ));
  GET DIAGNOSTICS v_count = ROW_COUNT;
  o_most := greatest(o_most, v_count); o_total := o_total + v_count;
  DELETE FROM __SCHEMA__.fences WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM __SCHEMA__.fences WHERE expires_at <= v_now
    LIMIT p_limit FOR UPDATE SKIP LOCKED
  ));
  GET DIAGNOSTICS v_count = ROW_COUNT;
  o_most := greatest(o_most, v_count); o_total := o_total + v_count;
  DELETE FROM __SCHEMA__.idempotency WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM __SCHEMA__.idempotency WHERE expires_at <= v_now
    LIMIT p_limit FOR UPDATE SKIP LOCKED
  ));
  GET DIAGNOSTICS v_count = ROW_COUNT;
  o_most := greatest(o_most, v_count); o_total := o_total + v_count;
  DELETE FROM __SCHEMA__.releases WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM __SCHEMA__.releases WHERE expires_at <= v_now
    LIMIT p_limit FOR UPDATE SKIP LOCKED
  ));
  GET DIAGNOSTICS v_count = ROW_COUNT;
  o_most := greatest(o_most, v_count); o_total := o_total + v_count;
END $$;
