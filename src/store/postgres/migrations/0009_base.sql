-- tollgate on PostgreSQL, the base: schema version 9, tables, indexes and the functions that
-- are the store's atomic operations. `__SCHEMA__` stands for the configured schema (quoted) and
-- `__RATE_TABLES__` for `UNLOGGED` or nothing. Every statement is idempotent. PgStore::migrate
-- first reads the version recorded in `migrations` (locking none of the tables below) and runs
-- the migrations only when the schema is older than the last numbered file beside this one,
-- its rate tables are to change persistence, or a function of version 1 is back (a copy of
-- version 1 started since): in one transaction under an advisory lock, so copies may run them
-- at once. This file runs first each time (it is every version up to 9 at once, and idempotent);
-- then each later file the schema has not recorded, in order. This file is no longer changed:
-- a new version is a new file.
--
-- Lock order: every function, the purge and the migration lock tables in this order, so that
-- no two of them can wait for each other in a cycle:
--   rate_limits, rate_log, rate_attempts, holds, permits, permit_queue, fences, idempotency,
--   releases, once_records (PgStore::once: its key's advisory lock, then its row)
-- A rate check locks its rate_limits rows (in key order) before it touches rate_log, and
-- rate_log before rate_attempts. A claim, lock, permit or idempotency call takes the advisory
-- lock of its key (lock_key) before its holds, permits or idempotency rows; lock_acquire and
-- permit_acquire then write fences; a release writes its releases row last.
-- purge_expired deletes table after table in this order (skipping locked rows), and a
-- migration locks every table that exists, in this order, before its first DDL.
--
-- Deadlines: every write function takes p_deadline_us, a time of the database clock in
-- microseconds. A call that reads the clock at or past it — after it has taken its locks, right
-- before it writes — changes nothing and answers "late": -1, or {-2, 0} from check_rate.
-- Version 2 added them; the functions of version 1, without p_deadline_us, are dropped here.
-- Version 3 added check_rates, a batch of rate checks in one call. Version 4 decides each rate
-- algorithm in one step function (rate_log_step, rate_counter_step, rate_gcra_step) for checks
-- of one limit and of several alike, and adds settlements (decide_rates, settle_rate), permits
-- (permit_*) and their tables; every function that version 3 had keeps its signature, so copies
-- of version 3 keep working on a schema of version 4.
-- Version 5 keeps the attempt ledger (rate_attempts; see docs/ledger.md): every charged attempt
-- is remembered there until its deadline plus a retention the client sends, and a reservation's
-- place until the limit stops counting it; `recent` and `recent_until` are no longer written
-- (read only for attempts that a copy of an earlier version charged, until their deadlines). A
-- check's reply carries the instant it was decided at. decide_rates, check_rate and settle_rate
-- take more parameters; decide_rates and check_rate of version 4, and check_rates of version
-- 3, keep their signatures and replies (their checks kept as reservations, their settlements
-- refunding), so copies of versions 3 and 4 keep working on a schema of version 5. The step
-- functions and settlements of version 4, which only the functions here call, are replaced.
-- Version 6 adds penalties (a limit's block_for): decide_rates and check_rate take each limit's
-- penalty, and a check denied by a limit with one blocks its caller on that limit, in a row of
-- rate_limits keyed by the limit's key plus ':block' (a = the block's end, µs; expiring then).
-- decide_rates and check_rate of version 5 keep their signatures and replies (no penalties), so
-- copies of version 5 keep working on a schema of version 6.
-- Version 7 keeps when an idempotency record was claimed (`idempotency.created_at`, set by
-- idem_begin), for operators' tools; a record of an earlier version has none. The signatures
-- and replies of every function stay, so copies of version 6 keep working on a schema of
-- version 7.
-- Version 8 names the life of each sliding-counter and GCRA row (`rate_limits.born`: the
-- attempt whose charge began it), and a reservation's place names the life it charged: a
-- refund comes only out of that life, never out of what others charged after a reset. The
-- step functions take the row's born and the attempt (their signatures of version 7 stay, for
-- the calls under way while the migration runs); a place of an earlier version (without lives)
-- refunds nothing. Signatures and replies of the functions copies call stay.
-- Version 9 adds held checks (RateCheck::held): decide_rates takes each check's hold (µs), for
-- which its units may still be admitted after the charge. A sliding log scores a held charge's
-- entry at its instant plus the hold (the row living until that score has left the window, an
-- expiry no later charge shortens); GCRA charges it from no earlier than its instant plus the
-- hold; a sliding counter ignores it. reset_rate takes a deadline as every write does: a reset
-- received after it erases nothing. The signatures of version 8 stay (holding nothing; a reset
-- without a deadline), so copies of version 8 keep working on a schema of version 9, and so do
-- the step functions' for the calls under way while the migration runs.
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
  FOREACH t IN ARRAY ARRAY['rate_limits', 'rate_log', 'rate_attempts', 'holds', 'permits',
                           'permit_queue', 'fences', 'idempotency', 'releases',
                           'once_records'] LOOP
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
-- version 4's steps and settlements, called only by the functions of this file
DROP FUNCTION IF EXISTS __SCHEMA__.rate_counter_step(text, bigint, bigint, bigint, boolean,
  bigint, bigint, bigint, bigint, boolean, boolean, bigint[], bigint[], bigint, bigint);
DROP FUNCTION IF EXISTS __SCHEMA__.rate_gcra_step(text, bigint, bigint, boolean, bigint, bigint,
  bigint, bigint, boolean, boolean, bigint[], bigint[], bigint, bigint);
DROP FUNCTION IF EXISTS __SCHEMA__.settle_rate(smallint, text[], bigint[], bigint[], bigint,
  bigint, bigint, bigint, bigint);
DROP FUNCTION IF EXISTS __SCHEMA__.settle_limit(smallint, __SCHEMA__.rate_limits, bigint, bigint,
  bigint, bigint, bigint, bigint);

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
-- `recent` and `recent_until` are the attempts that charged the row lately before version 5 and
-- until when each is remembered (its deadline, µs), on a policy's first limit: read, no longer
-- written (the attempts are in rate_attempts). `attempt` is no longer written. A row with
-- expires_at 0 is a placeholder, made only to be locked.
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
-- `born` (version 8): the attempt whose charge began a sliding-counter or GCRA row's life (NULL:
-- none yet, or written by an earlier version; the next charge names it).
ALTER TABLE __SCHEMA__.rate_limits ADD COLUMN IF NOT EXISTS born bigint;
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

-- The attempt ledger: one row per attempt that charged a policy's limits — a check admitted
-- with a cost, a settlement applied — keyed by the policy's first limit key, remembered until
-- `expires_at`: the call's deadline plus the retention the client sends (twice its timeout),
-- and for a reservation at least `place_until`. An attempt with a live row is a replay: it is
-- admitted and charges nothing. A reservation's row keeps `place`, where its charge went, until
-- `place_until` (NULL otherwise, and once a settlement has used it): per limit in order, a
-- sliding counter's window index; GCRA's arrival time and remainder right after the charge
-- (two numbers per limit). A sliding log keeps no place: its entries are named by the attempt.
-- Rows are deleted only by the purge, through the index on the expiry.
CREATE __RATE_TABLES__ TABLE IF NOT EXISTS __SCHEMA__.rate_attempts (
  key text NOT NULL,
  attempt bigint NOT NULL,
  expires_at bigint NOT NULL,
  place bigint[],
  place_until bigint NOT NULL DEFAULT 0,
  PRIMARY KEY (key, attempt)
);
CREATE INDEX IF NOT EXISTS rate_attempts_expiry ON __SCHEMA__.rate_attempts (expires_at);

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
-- when the record's request was claimed (µs of store time), for operators' tools; a record made
-- before the column has none
ALTER TABLE __SCHEMA__.idempotency ADD COLUMN IF NOT EXISTS created_at bigint;
CREATE INDEX IF NOT EXISTS idempotency_expiry ON __SCHEMA__.idempotency (expires_at);

-- Runs recorded by PgStore::once, in the same transaction as their work: the output of the
-- run that committed for a key, kept until expires_at.
CREATE TABLE IF NOT EXISTS __SCHEMA__.once_records (
  key text PRIMARY KEY,
  fingerprint text NOT NULL,
  output bytea NOT NULL,
  expires_at bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS once_records_expiry ON __SCHEMA__.once_records (expires_at);

-- ---------------------------------------------------------------------------------------------
-- Rate algorithms, written once: a step per algorithm decides one limit of a check on its row
-- (locked by the caller, read at the check's instant p_now) and answers the limit's reply, as
-- check_rate answers a check of that limit alone. With p_charge, a limit that admits the check
-- is charged there and then: a check of one limit is one step (check_rate). A check of several
-- limits is admitted only when each admits it: each limit's step runs first without charging;
-- then, the check admitted and costing, each limit is charged — a counter or GCRA limit by its
-- step run again with p_charge, a log by rate_log_charge on the log as its step left it
-- (rate_sliding_log, rate_sliding_counter, rate_gcra). An attempt that the ledger remembers
-- (a replay) is decided by check_rate as a look (cost 0), then admitted.
--   p_replay  (the sliding log) the attempt was found in the log of an earlier limit of the
--             check: admitted, no decision made
-- The reply: {admitted 0|1 (the cost fits, or a replay), retry_after_us (until the cost would
-- fit; 0 when admitted), remaining, reset_us (until what the limit has left grows)}; the
-- sliding log's step answers it field by field (o_admitted, o_retry, o_remaining, o_reset).
-- ---------------------------------------------------------------------------------------------

-- Sliding log, one limit: exact. The oldest rows leave the window first (a row scored s covers
-- (s - window, s]); the step trims what left it — the whole log once the row has expired, as
-- its Redis key would be gone — and writes the count that is left (p_a: the row's count). The
-- attempt found in the log when the cost does not fit is a replay (o_replay). It charges
-- through rate_log_charge, which a check of several limits calls itself once every limit has
-- been decided: o_count and o_oldest (NULL: the log is empty) are the log as the step left it.
-- p_hold: how long after p_now the charge's units may still be admitted (µs; version 9), which
-- dates its entry (see rate_log_charge); the decision is the same whatever the hold. Entries
-- dated in the future count as any other until they leave the window.
-- Cost: O(trimmed) plus index look-ups; a denial adds one scan of the log for the wait.
CREATE OR REPLACE FUNCTION __SCHEMA__.rate_log_step(
  p_key text, p_a bigint, p_expires bigint, p_quota bigint, p_window bigint, p_cost bigint,
  p_attempt bigint, p_now bigint, p_replay boolean, p_charge boolean, p_hold bigint,
  OUT o_admitted boolean, OUT o_replay boolean, OUT o_retry bigint, OUT o_count bigint,
  OUT o_oldest bigint, OUT o_remaining bigint, OUT o_reset bigint
) LANGUAGE plpgsql AS $$
DECLARE
  v_trimmed bigint;
  v_wait bigint;
  v_charge record;
BEGIN
  o_admitted := true; o_replay := p_replay; o_retry := 0;
  IF p_expires <= p_now THEN
    DELETE FROM __SCHEMA__.rate_log WHERE key = p_key;
    o_count := 0;
    v_trimmed := p_a;
  ELSE
    -- trimmed, then the oldest read, in two statements: as one they got a much slower plan
    WITH gone AS (
      DELETE FROM __SCHEMA__.rate_log
      WHERE key = p_key AND score <= p_now - p_window
      RETURNING cost
    ) SELECT coalesce(sum(cost), 0) INTO v_trimmed FROM gone;
    o_count := greatest(p_a - v_trimmed, 0);
  END IF;
  IF o_count > 0 THEN
    SELECT min(score) INTO o_oldest FROM __SCHEMA__.rate_log WHERE key = p_key;
  END IF;
  IF NOT p_replay AND o_count + p_cost > p_quota THEN
    IF p_cost > 0 AND o_count > 0 AND EXISTS (
      SELECT 1 FROM __SCHEMA__.rate_log WHERE key = p_key AND attempt = p_attempt
    ) THEN
      o_replay := true; -- charged by the first run of this attempt
    ELSE
      o_admitted := false;
      v_wait := p_window;
      IF p_cost <= p_quota THEN
        -- room appears once the (count + cost - quota) oldest units have left the window
        SELECT l.score + p_window - p_now INTO v_wait FROM (
          SELECT score, sum(cost) OVER (ORDER BY score, attempt) AS upto
          FROM __SCHEMA__.rate_log WHERE key = p_key
        ) AS l
        WHERE l.upto >= o_count + p_cost - p_quota
        ORDER BY l.upto LIMIT 1;
      END IF;
      o_retry := greatest(0, v_wait);
    END IF;
  END IF;
  -- a replay's attempt is in this log: a charge would log nothing
  IF p_charge AND o_admitted AND NOT o_replay AND p_cost > 0 THEN
    v_charge := __SCHEMA__.rate_log_charge(p_key, o_count, o_oldest, p_quota, p_window, p_cost,
      p_attempt, p_now, p_hold);
    IF v_charge.o_logged THEN
      -- the charge wrote the count
      o_remaining := v_charge.o_remaining;
      o_reset := v_charge.o_reset;
      RETURN;
    END IF;
  END IF;
  IF v_trimmed > 0 THEN
    UPDATE __SCHEMA__.rate_limits SET a = o_count WHERE key = p_key;
  END IF;
  o_remaining := greatest(p_quota - o_count, 0);
  o_reset := CASE WHEN o_oldest IS NULL THEN 0 ELSE o_oldest + p_window - p_now END;
END $$;

-- Sliding log, one limit decided by rate_log_step (p_count, p_oldest: its o_count, o_oldest):
-- logs the attempt's cost, once — an attempt logged already is not logged again (o_logged
-- false) — and sets the row's count and expiry. The entry is scored p_now plus the hold p_hold
-- (µs: its units may be admitted until then), and the row lives until that score has left the
-- window: an expiry that an entry scored later set stays. Answers as rate_log_step.
CREATE OR REPLACE FUNCTION __SCHEMA__.rate_log_charge(
  p_key text, p_count bigint, p_oldest bigint, p_quota bigint, p_window bigint, p_cost bigint,
  p_attempt bigint, p_now bigint, p_hold bigint,
  OUT o_logged boolean, OUT o_remaining bigint, OUT o_reset bigint
) LANGUAGE plpgsql AS $$
DECLARE
  v_score bigint := p_now + greatest(coalesce(p_hold, 0), 0);
  v_expires bigint;
BEGIN
  o_reset := CASE WHEN p_oldest IS NULL THEN 0 ELSE p_oldest + p_window - p_now END;
  INSERT INTO __SCHEMA__.rate_log (key, attempt, score, cost)
    VALUES (p_key, p_attempt, v_score, p_cost)
    ON CONFLICT DO NOTHING;
  o_logged := FOUND;
  IF o_logged THEN
    p_count := p_count + p_cost;
    -- the oldest entry is this request's when the log was empty, or held all it had for longer
    o_reset := least(coalesce(p_oldest, v_score), v_score) + p_window - p_now;
    v_expires := v_score + __SCHEMA__.ceil_div(p_window, 1000) * 1000;
    UPDATE __SCHEMA__.rate_limits
      SET a = p_count, expires_at = greatest(expires_at, v_expires),
          purge_at = __SCHEMA__.purge_mark(purge_at, greatest(expires_at, v_expires), p_window)
      WHERE key = p_key;
  END IF;
  o_remaining := greatest(p_quota - p_count, 0);
END $$;

-- The index of the sliding-counter window (of p_window µs, counted in whole milliseconds of
-- store time) that holds the instant p_now: the window of a charge made then.
CREATE OR REPLACE FUNCTION __SCHEMA__.counter_window(p_now bigint, p_window bigint)
RETURNS bigint LANGUAGE sql IMMUTABLE AS $$
  SELECT floor((p_now / 1000)::double precision / (p_window / 1000.0)::double precision)::bigint
$$;

-- Sliding-window counter, one limit: O(1), in milliseconds of store time and in doubles, as
-- the Lua script computes it: current + previous * (share of the previous window still inside
-- the sliding one). p_a, p_b, p_c: the row's window index and the costs of that window and of
-- the one before; p_live: the row has not expired. A charge adds the cost to the current
-- window, counter_window(p_now, p_window) (a new one moves the row's expiry to the end of the
-- next window). p_born: the row's life; a charge by p_attempt that finds none living (no row,
-- or one of a window before the previous one) begins one, named p_attempt. The reply has one
-- more number: the life the row is left in (NULL when nothing was charged and none lives).
CREATE OR REPLACE FUNCTION __SCHEMA__.rate_counter_step(
  p_key text, p_a bigint, p_b bigint, p_c bigint, p_live boolean, p_quota bigint,
  p_window bigint, p_cost bigint, p_now bigint, p_charge boolean, p_born bigint,
  p_attempt bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  v_admitted boolean := true;
  v_retry bigint := 0;
  q double precision := p_quota;
  w double precision := p_window / 1000.0;
  v_now double precision := (p_now / 1000)::double precision;
  v_cost double precision := p_cost::double precision;
  idx double precision;
  el double precision;
  cur double precision := 0;
  prev double precision := 0;
  v_same boolean := false;
  room double precision;
  wait double precision;
  used double precision;
  whole double precision;
  rst double precision := 0;
  v_born bigint;
BEGIN
  idx := __SCHEMA__.counter_window(p_now, p_window);
  el := v_now - idx * w;
  IF p_live THEN
    IF p_a = idx THEN
      cur := p_b; prev := p_c; v_same := true; v_born := p_born;
    ELSIF p_a = idx - 1 THEN
      prev := p_b; v_born := p_born;
    END IF;
  END IF;
  IF (cur + v_cost) * w + prev * (w - el) > q * w THEN
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
    v_retry := ceil(greatest(wait, 0) * 1000)::bigint;
  ELSIF p_charge AND p_cost > 0 THEN
    cur := cur + v_cost;
    v_born := coalesce(v_born, p_attempt);
    IF v_same THEN
      -- the same window: its expiry (the end of the next window) stands
      UPDATE __SCHEMA__.rate_limits SET b = cur::bigint, born = v_born WHERE key = p_key;
    ELSE
      UPDATE __SCHEMA__.rate_limits
        SET a = idx::bigint, b = cur::bigint, c = prev::bigint, born = v_born,
            expires_at = (p_now / 1000) * 1000 + ceil(2 * w - el)::bigint * 1000,
            purge_at = __SCHEMA__.purge_mark(purge_at,
              (p_now / 1000) * 1000 + ceil(2 * w - el)::bigint * 1000, p_window)
        WHERE key = p_key;
    END IF;
  END IF;
  used := cur + prev * (w - el) / w;
  whole := ceil(used - 1e-9);
  -- the quota grows when the estimate next drops below a whole unit
  IF whole > 0 AND prev > 0 AND whole - 1 - cur >= 0 THEN
    rst := (w - el) - (whole - 1 - cur) * w / prev;
  ELSIF whole > 0 THEN
    rst := (w - el) + w - (whole - 1) * w / cur;
  END IF;
  RETURN ARRAY[CASE WHEN v_admitted THEN 1 ELSE 0 END, v_retry,
    greatest(q - whole, 0)::bigint, ceil(rst * 1000)::bigint, v_born];
END $$;

-- GCRA, one limit: O(1), exact in integers. Emission interval T = window / quota; offsets from
-- now are counted in 1/quota microseconds, where T is exactly `window` units. p_a, p_b: the
-- row's theoretical arrival time and remainder; p_live: the row has not expired. A charge moves
-- the arrival time on by the cost (the row expiring a millisecond after it). p_born: the row's
-- life; a charge by p_attempt that finds none living (no row, or its arrival time passed)
-- begins one, named p_attempt. The reply has three more numbers: the arrival time, remainder
-- and life the limit is left with (after the charge).
-- p_hold (version 9): how long after p_now a check of a cost may still have its units
-- admitted (µs; a look ignores it). Its charge starts from the arrival time or p_now + p_hold,
-- whichever is later (the remainder 0 when the latter), and is decided against p_now as any
-- other: a hold that passes the window denies it. The life follows the row, as without one.
CREATE OR REPLACE FUNCTION __SCHEMA__.rate_gcra_step(
  p_key text, p_a bigint, p_b bigint, p_live boolean, p_quota bigint, p_window bigint,
  p_cost bigint, p_now bigint, p_charge boolean, p_born bigint, p_attempt bigint,
  p_hold bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  v_admitted boolean := true;
  v_retry bigint := 0;
  tat bigint := p_now;
  rem bigint := 0;
  v_tat bigint;
  v_rem bigint;
  ahead bigint;
  units bigint;
  whole bigint;
  used bigint;
  v_born bigint;
BEGIN
  IF p_live AND p_a >= p_now THEN tat := p_a; rem := p_b; v_born := p_born; END IF;
  -- where a charge starts
  v_tat := tat; v_rem := rem;
  IF p_cost > 0 AND p_now + greatest(coalesce(p_hold, 0), 0) > tat THEN
    v_tat := p_now + greatest(coalesce(p_hold, 0), 0);
    v_rem := 0;
  END IF;
  IF p_cost > p_quota THEN
    v_admitted := false;
    v_retry := p_window;
  ELSIF v_tat - p_now > p_window THEN
    -- a hold past the window: denied, its wait counted without multiplying the hold by the
    -- quota (ahead - window * quota = (v_tat - p_now - window) * quota + the rest)
    v_admitted := false;
    v_retry := v_tat - p_now - p_window + __SCHEMA__.ceil_div(v_rem + p_cost * p_window, p_quota);
  ELSE
    ahead := (v_tat - p_now) * p_quota + v_rem + p_cost * p_window;
    IF ahead > p_window * p_quota THEN
      v_admitted := false;
      v_retry := __SCHEMA__.ceil_div(ahead - p_window * p_quota, p_quota);
    ELSIF p_charge AND p_cost > 0 THEN
      units := v_rem + p_cost * p_window;
      whole := units / p_quota;
      tat := v_tat + whole;
      rem := units - whole * p_quota;
      v_born := coalesce(v_born, p_attempt);
      UPDATE __SCHEMA__.rate_limits
        SET a = tat, b = rem, born = v_born,
            expires_at = p_now + (__SCHEMA__.ceil_div(tat - p_now, 1000) + 1) * 1000,
            purge_at = __SCHEMA__.purge_mark(purge_at,
              p_now + (__SCHEMA__.ceil_div(tat - p_now, 1000) + 1) * 1000, p_window)
        WHERE key = p_key;
    END IF;
  END IF;
  ahead := (tat - p_now) * p_quota + rem;
  used := __SCHEMA__.ceil_div(ahead, p_window);
  RETURN ARRAY[CASE WHEN v_admitted THEN 1 ELSE 0 END, v_retry, greatest(p_quota - used, 0),
    CASE WHEN used > 0 THEN __SCHEMA__.ceil_div(ahead - (used - 1) * p_window, p_quota)
         ELSE 0 END, tat, rem, v_born];
END $$;

-- The steps as versions 5 to 7 called them, without lives: a call of a copy of version 7 that
-- began before this migration committed runs the body it began with, which calls these; they
-- charge through the steps above, naming no life (the next charge names it).
CREATE OR REPLACE FUNCTION __SCHEMA__.rate_counter_step(
  p_key text, p_a bigint, p_b bigint, p_c bigint, p_live boolean, p_quota bigint,
  p_window bigint, p_cost bigint, p_now bigint, p_charge boolean
) RETURNS bigint[] LANGUAGE sql AS $$
  SELECT (__SCHEMA__.rate_counter_step(p_key, p_a, p_b, p_c, p_live, p_quota, p_window, p_cost,
    p_now, p_charge, NULL, NULL))[1:4]
$$;
CREATE OR REPLACE FUNCTION __SCHEMA__.rate_gcra_step(
  p_key text, p_a bigint, p_b bigint, p_live boolean, p_quota bigint, p_window bigint,
  p_cost bigint, p_now bigint, p_charge boolean
) RETURNS bigint[] LANGUAGE sql AS $$
  SELECT (__SCHEMA__.rate_gcra_step(p_key, p_a, p_b, p_live, p_quota, p_window, p_cost, p_now,
    p_charge, NULL, NULL, 0))[1:6]
$$;

-- The steps as version 8 called them, without holds (for the calls under way while the
-- migration runs, as above): they decide and charge as the steps above with a hold of 0.
CREATE OR REPLACE FUNCTION __SCHEMA__.rate_gcra_step(
  p_key text, p_a bigint, p_b bigint, p_live boolean, p_quota bigint, p_window bigint,
  p_cost bigint, p_now bigint, p_charge boolean, p_born bigint, p_attempt bigint
) RETURNS bigint[] LANGUAGE sql AS $$
  SELECT __SCHEMA__.rate_gcra_step(p_key, p_a, p_b, p_live, p_quota, p_window, p_cost, p_now,
    p_charge, p_born, p_attempt, 0)
$$;
CREATE OR REPLACE FUNCTION __SCHEMA__.rate_log_step(
  p_key text, p_a bigint, p_expires bigint, p_quota bigint, p_window bigint, p_cost bigint,
  p_attempt bigint, p_now bigint, p_replay boolean, p_charge boolean,
  OUT o_admitted boolean, OUT o_replay boolean, OUT o_retry bigint, OUT o_count bigint,
  OUT o_oldest bigint, OUT o_remaining bigint, OUT o_reset bigint
) LANGUAGE sql AS $$
  SELECT * FROM __SCHEMA__.rate_log_step(p_key, p_a, p_expires, p_quota, p_window, p_cost,
    p_attempt, p_now, p_replay, p_charge, 0)
$$;
CREATE OR REPLACE FUNCTION __SCHEMA__.rate_log_charge(
  p_key text, p_count bigint, p_oldest bigint, p_quota bigint, p_window bigint, p_cost bigint,
  p_attempt bigint, p_now bigint,
  OUT o_logged boolean, OUT o_remaining bigint, OUT o_reset bigint
) LANGUAGE sql AS $$
  SELECT * FROM __SCHEMA__.rate_log_charge(p_key, p_count, p_oldest, p_quota, p_window, p_cost,
    p_attempt, p_now, 0)
$$;

-- Locks the rate_limits rows of p_keys in key order, made first where missing, so that checks
-- and settlements over overlapping keys cannot deadlock; held until the transaction ends.
CREATE OR REPLACE FUNCTION __SCHEMA__.lock_rate_rows(p_keys text[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
  v_locked int;
BEGIN
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
END $$;

-- ---------------------------------------------------------------------------------------------
-- The attempt ledger (rate_attempts), read and written by check_rate and settle_rate while they
-- hold the locks of their rows (the first limit's among them), so that two runs of one attempt
-- are decided one after the other.
-- ---------------------------------------------------------------------------------------------

-- Whether attempt p_attempt of the policy whose first limit key is p_key is remembered at p_now:
-- its ledger row is live, or — charged by a copy of an earlier version — it is among p_recent,
-- the `recent` attempts of that key's row ('{}' once the row has expired), until its deadline
-- in p_until.
CREATE OR REPLACE FUNCTION __SCHEMA__.remembered(
  p_key text, p_attempt bigint, p_now bigint, p_recent bigint[], p_until bigint[]
) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
  IF p_attempt = ANY (p_recent) AND EXISTS (
    SELECT 1 FROM unnest(p_recent, p_until) AS r (id, until)
    WHERE r.id = p_attempt AND r.until > p_now
  ) THEN
    RETURN true;
  END IF;
  RETURN EXISTS (
    SELECT 1 FROM __SCHEMA__.rate_attempts
    WHERE key = p_key AND attempt = p_attempt AND expires_at > p_now
  );
END $$;

-- Remembers attempt p_attempt under p_key until p_until (µs), with the place p_place kept until
-- p_place_until (the row lives at least as long). A row of the attempt that is there already
-- has expired (a live one makes the attempt a replay, which writes nothing): it is replaced.
CREATE OR REPLACE FUNCTION __SCHEMA__.remember_attempt(
  p_key text, p_attempt bigint, p_until bigint, p_place bigint[], p_place_until bigint
) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO __SCHEMA__.rate_attempts (key, attempt, expires_at, place, place_until)
    VALUES (p_key, p_attempt, greatest(p_until, p_place_until), p_place, p_place_until)
    ON CONFLICT (key, attempt) DO UPDATE
      SET expires_at = EXCLUDED.expires_at, place = EXCLUDED.place,
          place_until = EXCLUDED.place_until;
END $$;

-- ---------------------------------------------------------------------------------------------
-- check_rate: one rate check, all limits of a policy at once (mirrors scripts/rate.lua).
--   p_algorithm  1 sliding log, 2 sliding counter, 3 GCRA
--   p_keys, p_quotas, p_windows  per limit its key, quota and window (µs), in configuration
--                order (distinct keys)
--   p_cost       >= 0; 0 only looks
--   p_attempt    the attempt id: once charged, remembered in the ledger under p_keys[1] until
--                p_deadline_us + p_retention_us; sent again meanwhile, it is a replay — admitted,
--                charging nothing, answering the limits as they stand
--   p_reservation  the check will be settled: its ledger row keeps where its charge went (its
--                place), for as long as the limits count it — a sliding counter the index of the
--                window charged, until that window's successor ends; GCRA the arrival time and
--                remainder right after the charge, until that arrival time; a sliding log
--                nothing (its entries are named by the attempt)
--   p_hold       (version 9) how long after the charge its units may still be admitted (µs,
--                >= 0): a sliding log scores its entries, and GCRA starts its charge, that
--                much later (see the steps); a look, or a replay, holds nothing
--   p_deadline_us  received at or after it (database clock), the check charges nothing
-- Returns {admitted 0|1, retry_after_us, decided_at_us (the clock it was decided at), then per
-- limit remaining, reset_us}, or {-2, 0} when received late.
-- Locks every limit's row in key order (made first if missing), so that checks over
-- overlapping keys cannot deadlock, then reads the clock: concurrent checks of one caller are
-- decided one after the other, each at its own instant. A check denied, or a look, leaves no
-- ledger row.
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION __SCHEMA__.check_rate(
  p_algorithm smallint, p_keys text[], p_quotas bigint[], p_windows bigint[],
  p_cost bigint, p_attempt bigint, p_reservation boolean, p_hold bigint,
  p_retention_us bigint, p_deadline_us bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  v_hold bigint := 0;
  v_key text := p_keys[1];
  v_n int := cardinality(p_keys);
  r_a bigint;
  r_b bigint;
  r_c bigint;
  r_born bigint;
  r_recent bigint[];
  r_until bigint[];
  r_expires bigint;
  v_now bigint;
  v_cost bigint := p_cost;
  v_replay boolean := false;
  v_reply bigint[];
  v_log record;
  v_place bigint[];
  v_place_until bigint := 0;
  v_index bigint;
BEGIN
  -- late already: not even a placeholder row is made
  IF __SCHEMA__.now_us() >= p_deadline_us THEN RETURN ARRAY[-2, 0]; END IF;
  IF v_n <> 1 THEN PERFORM __SCHEMA__.lock_rate_rows(p_keys); END IF;
  -- The first limit's row, read once. One limit (the common policy): its row is locked by
  -- reading it (made first if missing; holding no other row, this cannot deadlock).
  LOOP
    SELECT l.a, l.b, l.c, l.born, l.recent, l.recent_until, l.expires_at
      INTO r_a, r_b, r_c, r_born, r_recent, r_until, r_expires
      FROM __SCHEMA__.rate_limits AS l WHERE l.key = v_key FOR UPDATE;
    EXIT WHEN FOUND;
    -- missing, or deleted (purged, reset) before it could be locked: made, then locked
    INSERT INTO __SCHEMA__.rate_limits (key) VALUES (v_key) ON CONFLICT DO NOTHING;
  END LOOP;
  v_now := __SCHEMA__.now_us();
  IF v_now >= p_deadline_us THEN RETURN ARRAY[-2, 0]; END IF;
  IF p_cost > 0 THEN
    -- an expired row remembers nothing, as an expired Redis key holds nothing
    IF r_expires <= v_now THEN r_recent := '{}'; r_until := '{}'; END IF;
    v_replay := __SCHEMA__.remembered(v_key, p_attempt, v_now, r_recent, r_until);
    -- a replay looks: the limits as they stand
    IF v_replay THEN v_cost := 0; END IF;
  END IF;
  IF v_cost > 0 THEN v_hold := greatest(coalesce(p_hold, 0), 0); END IF;
  IF v_n <> 1 THEN
    IF p_algorithm = 1 THEN
      v_reply := __SCHEMA__.rate_sliding_log(p_keys, p_quotas, p_windows, v_cost, p_attempt,
        v_now, v_hold);
    ELSIF p_algorithm = 2 THEN
      -- a sliding counter ignores the hold
      v_reply := __SCHEMA__.rate_sliding_counter(p_keys, p_quotas, p_windows, v_cost,
        p_attempt, v_now, p_deadline_us);
    ELSE
      v_reply := __SCHEMA__.rate_gcra(p_keys, p_quotas, p_windows, v_cost, p_attempt, v_now,
        p_deadline_us, v_hold);
    END IF;
  ELSIF p_algorithm = 1 THEN
    v_log := __SCHEMA__.rate_log_step(v_key, r_a, r_expires, p_quotas[1], p_windows[1],
      v_cost, p_attempt, v_now, false, true, v_hold);
    v_reply := ARRAY[CASE WHEN v_log.o_admitted THEN 1 ELSE 0 END, v_log.o_retry,
      v_log.o_remaining, v_log.o_reset];
  ELSIF p_algorithm = 2 THEN
    v_reply := __SCHEMA__.rate_counter_step(v_key, r_a, r_b, r_c, r_expires > v_now,
      p_quotas[1], p_windows[1], v_cost, v_now, true, r_born, p_attempt);
  ELSE
    v_reply := __SCHEMA__.rate_gcra_step(v_key, r_a, r_b, r_expires > v_now, p_quotas[1],
      p_windows[1], v_cost, v_now, true, r_born, p_attempt, v_hold);
  END IF;
  IF v_replay THEN
    RETURN ARRAY[1, 0, v_now] || v_reply[3:2 + 2 * v_n];
  END IF;
  -- charged: remembered, with a reservation's place
  IF v_reply[1] = 1 AND p_cost > 0 THEN
    IF p_reservation AND p_algorithm = 2 THEN
      v_place := '{}';
      FOR i IN 1..v_n LOOP
        v_index := __SCHEMA__.counter_window(v_now, p_windows[i]);
        IF v_n = 1 THEN
          v_place := ARRAY[v_index, v_reply[5]];
        ELSE
          SELECT v_place || ARRAY[v_index, l.born] INTO v_place
            FROM __SCHEMA__.rate_limits AS l WHERE l.key = p_keys[i];
        END IF;
        v_place_until := greatest(v_place_until, (v_index + 2) * p_windows[i]);
      END LOOP;
    ELSIF p_reservation AND p_algorithm = 3 THEN
      IF v_n = 1 THEN
        v_place := v_reply[5:7];
      ELSE
        v_place := '{}';
        FOR i IN 1..v_n LOOP
          SELECT v_place || ARRAY[l.a, l.b, l.born] INTO v_place
            FROM __SCHEMA__.rate_limits AS l WHERE l.key = p_keys[i];
        END LOOP;
      END IF;
      FOR i IN 1..v_n LOOP
        v_place_until := greatest(v_place_until, v_place[3 * i - 2]);
      END LOOP;
    END IF;
    PERFORM __SCHEMA__.remember_attempt(v_key, p_attempt, p_deadline_us + p_retention_us,
      v_place, v_place_until);
  END IF;
  RETURN v_reply[1:2] || v_now || v_reply[3:2 + 2 * v_n];
END $$;

-- check_rate of versions 5 to 8, as above holding nothing.
CREATE OR REPLACE FUNCTION __SCHEMA__.check_rate(
  p_algorithm smallint, p_keys text[], p_quotas bigint[], p_windows bigint[],
  p_cost bigint, p_attempt bigint, p_reservation boolean, p_retention_us bigint,
  p_deadline_us bigint
) RETURNS bigint[] LANGUAGE sql AS $$
  SELECT __SCHEMA__.check_rate(p_algorithm, p_keys, p_quotas, p_windows, p_cost, p_attempt,
    p_reservation, 0::bigint, p_retention_us, p_deadline_us)
$$;

-- ---------------------------------------------------------------------------------------------
-- Penalties (version 6; as rate.lua): a check (cost > 0, not a settlement) that a limit with a
-- penalty (p_blocks[i] > 0, µs) denies, of a caller not blocked yet, blocks the caller on that
-- limit until the decision's instant plus the penalty: its block row (the limit's key plus
-- ':block' in rate_limits, a = the block's end) is written in the same transaction. While any
-- block of the check's limits has not ended, the check is denied and charges nothing (an attempt
-- the ledger remembers, or a log holds, is admitted as always): it waits at least until the
-- latest block ends, and each blocking limit answers remaining 0 and the time its block has
-- left. A denial while blocked writes nothing: the block is not extended. reset_rate deletes
-- the block rows it is given.
-- ---------------------------------------------------------------------------------------------

-- The end of each limit's block at p_now (0: none, or ended).
CREATE OR REPLACE FUNCTION __SCHEMA__.rate_blocks(
  p_keys text[], p_blocks bigint[], p_now bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  v_tills bigint[] := '{}';
  v_till bigint;
BEGIN
  FOR i IN 1..cardinality(p_keys) LOOP
    v_till := NULL;
    IF p_blocks[i] > 0 THEN
      SELECT a INTO v_till FROM __SCHEMA__.rate_limits
        WHERE key = p_keys[i] || ':block' AND expires_at > p_now;
    END IF;
    v_tills := v_tills || coalesce(v_till, 0);
  END LOOP;
  RETURN v_tills;
END $$;

-- Decides a check of cost p_cost (held for p_hold µs) on every limit at p_now and charges
-- nothing, each limit's step alone: {replay 0|1 (a log holds the attempt), retry_after_us, then
-- per limit denied 0|1, remaining, reset_us}.
CREATE OR REPLACE FUNCTION __SCHEMA__.rate_look(
  p_algorithm smallint, p_keys text[], p_quotas bigint[], p_windows bigint[], p_cost bigint,
  p_attempt bigint, p_now bigint, p_hold bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  v_replay boolean := false;
  v_retry bigint := 0;
  v_limits bigint[] := '{}';
  v_row __SCHEMA__.rate_limits;
  v_log record;
  v_step bigint[];
BEGIN
  FOR i IN 1..cardinality(p_keys) LOOP
    SELECT * INTO v_row FROM __SCHEMA__.rate_limits WHERE key = p_keys[i];
    IF p_algorithm = 1 THEN
      v_log := __SCHEMA__.rate_log_step(p_keys[i], v_row.a, v_row.expires_at, p_quotas[i],
        p_windows[i], p_cost, p_attempt, p_now, v_replay, false, p_hold);
      v_replay := v_log.o_replay;
      v_step := ARRAY[CASE WHEN v_log.o_admitted THEN 1 ELSE 0 END, v_log.o_retry,
        v_log.o_remaining, v_log.o_reset];
    ELSIF p_algorithm = 2 THEN
      v_step := __SCHEMA__.rate_counter_step(p_keys[i], v_row.a, v_row.b, v_row.c,
        v_row.expires_at > p_now, p_quotas[i], p_windows[i], p_cost, p_now, false, NULL, 0);
    ELSE
      v_step := __SCHEMA__.rate_gcra_step(p_keys[i], v_row.a, v_row.b,
        v_row.expires_at > p_now, p_quotas[i], p_windows[i], p_cost, p_now, false, NULL, 0,
        p_hold);
    END IF;
    v_retry := greatest(v_retry, v_step[2]);
    v_limits := v_limits || ARRAY[1 - v_step[1], v_step[3], v_step[4]];
  END LOOP;
  RETURN ARRAY[CASE WHEN v_replay THEN 1 ELSE 0 END, v_retry] || v_limits;
END $$;

-- rate_look of versions 6 to 8: holding nothing.
CREATE OR REPLACE FUNCTION __SCHEMA__.rate_look(
  p_algorithm smallint, p_keys text[], p_quotas bigint[], p_windows bigint[], p_cost bigint,
  p_attempt bigint, p_now bigint
) RETURNS bigint[] LANGUAGE sql AS $$
  SELECT __SCHEMA__.rate_look(p_algorithm, p_keys, p_quotas, p_windows, p_cost, p_attempt,
    p_now, 0::bigint)
$$;

-- The penalties of a denied check (p_reply: check_rate's reply; p_look: rate_look's at the same
-- instant, p_now; p_tills: rate_blocks'; p_blocked: a block had not ended): a caller not
-- blocked yet is blocked on each limit with a penalty that denied a cost; each limit that
-- blocks it answers remaining 0 and the time its block has left, and the check waits at least
-- until the latest block ends. The reply so changed.
CREATE OR REPLACE FUNCTION __SCHEMA__.rate_penalize(
  p_keys text[], p_blocks bigint[], p_cost bigint, p_reply bigint[], p_look bigint[],
  p_tills bigint[], p_blocked boolean, p_now bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
BEGIN
  FOR i IN 1..cardinality(p_keys) LOOP
    IF p_blocks[i] > 0 AND NOT p_blocked AND p_cost > 0 AND p_look[3 * i] = 1 THEN
      p_tills[i] := p_now + p_blocks[i];
      UPDATE __SCHEMA__.rate_limits
        SET a = p_tills[i], expires_at = p_tills[i],
            purge_at = __SCHEMA__.purge_mark(purge_at, p_tills[i], p_blocks[i])
        WHERE key = p_keys[i] || ':block';
    END IF;
    IF p_blocks[i] > 0 AND p_tills[i] > p_now THEN
      p_reply[2 + 2 * i] := 0;
      p_reply[3 + 2 * i] := p_tills[i] - p_now;
      p_reply[2] := greatest(p_reply[2], p_tills[i] - p_now);
    END IF;
  END LOOP;
  RETURN p_reply;
END $$;

-- check_rate with penalties (version 6): as check_rate above, p_blocks holding each limit's
-- penalty (µs; 0 or NULL: none). Without one it is check_rate. With one, the limits' rows and
-- block rows are locked in key order and the blocks read first; a blocked caller is answered
-- from rate_look (or, a replay, by check_rate), else check_rate decides and a denial is
-- penalized, at check_rate's instant. A check's hold (version 9) counts in every decision.
CREATE OR REPLACE FUNCTION __SCHEMA__.check_rate(
  p_algorithm smallint, p_keys text[], p_quotas bigint[], p_windows bigint[],
  p_blocks bigint[], p_cost bigint, p_attempt bigint, p_reservation boolean, p_hold bigint,
  p_retention_us bigint, p_deadline_us bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  v_blocks text[] := '{}';
  v_now bigint;
  v_tills bigint[];
  v_reply bigint[];
  v_look bigint[];
  v_row __SCHEMA__.rate_limits;
BEGIN
  FOR i IN 1..cardinality(p_keys) LOOP
    IF p_blocks[i] > 0 THEN v_blocks := v_blocks || (p_keys[i] || ':block'); END IF;
  END LOOP;
  IF cardinality(v_blocks) = 0 THEN
    RETURN __SCHEMA__.check_rate(p_algorithm, p_keys, p_quotas, p_windows, p_cost, p_attempt,
      p_reservation, p_hold, p_retention_us, p_deadline_us);
  END IF;
  IF __SCHEMA__.now_us() >= p_deadline_us THEN RETURN ARRAY[-2, 0]; END IF;
  PERFORM __SCHEMA__.lock_rate_rows(p_keys || v_blocks);
  v_now := __SCHEMA__.now_us();
  IF v_now >= p_deadline_us THEN RETURN ARRAY[-2, 0]; END IF;
  v_tills := __SCHEMA__.rate_blocks(p_keys, p_blocks, v_now);
  IF (SELECT max(t) FROM unnest(v_tills) AS t) > v_now THEN
    SELECT * INTO v_row FROM __SCHEMA__.rate_limits WHERE key = p_keys[1];
    IF v_row.expires_at <= v_now THEN v_row.recent := '{}'; v_row.recent_until := '{}'; END IF;
    v_look := __SCHEMA__.rate_look(p_algorithm, p_keys, p_quotas, p_windows, p_cost,
      p_attempt, v_now, p_hold);
    IF NOT (v_look[1] = 1 OR (p_cost > 0 AND __SCHEMA__.remembered(p_keys[1], p_attempt, v_now,
        v_row.recent, v_row.recent_until))) THEN
      v_reply := ARRAY[0, v_look[2], v_now];
      FOR i IN 1..cardinality(p_keys) LOOP
        v_reply := v_reply || v_look[3 * i + 1:3 * i + 2];
      END LOOP;
      RETURN __SCHEMA__.rate_penalize(p_keys, p_blocks, p_cost, v_reply, v_look, v_tills, true,
        v_now);
    END IF;
  END IF;
  -- not blocked, or a replay: decided as without penalties
  v_reply := __SCHEMA__.check_rate(p_algorithm, p_keys, p_quotas, p_windows, p_cost, p_attempt,
    p_reservation, p_hold, p_retention_us, p_deadline_us);
  IF v_reply[1] <> 0 THEN RETURN v_reply; END IF;
  v_look := __SCHEMA__.rate_look(p_algorithm, p_keys, p_quotas, p_windows, p_cost, p_attempt,
    v_reply[3], p_hold);
  RETURN __SCHEMA__.rate_penalize(p_keys, p_blocks, p_cost, v_reply, v_look, v_tills, false,
    v_reply[3]);
END $$;

-- check_rate with penalties of versions 6 to 8: holding nothing.
CREATE OR REPLACE FUNCTION __SCHEMA__.check_rate(
  p_algorithm smallint, p_keys text[], p_quotas bigint[], p_windows bigint[],
  p_blocks bigint[], p_cost bigint, p_attempt bigint, p_reservation boolean,
  p_retention_us bigint, p_deadline_us bigint
) RETURNS bigint[] LANGUAGE sql AS $$
  SELECT __SCHEMA__.check_rate(p_algorithm, p_keys, p_quotas, p_windows, p_blocks, p_cost,
    p_attempt, p_reservation, 0::bigint, p_retention_us, p_deadline_us)
$$;

-- check_rate of versions 2 to 4, as above: a charged check is kept as a reservation and
-- remembered for twice the time its call had left after its deadline; the reply is without
-- decided_at_us.
CREATE OR REPLACE FUNCTION __SCHEMA__.check_rate(
  p_algorithm smallint, p_keys text[], p_quotas bigint[], p_windows bigint[],
  p_cost bigint, p_attempt bigint, p_deadline_us bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  v_reply bigint[];
BEGIN
  v_reply := __SCHEMA__.check_rate(p_algorithm, p_keys, p_quotas, p_windows, p_cost, p_attempt,
    true, 2 * greatest(p_deadline_us - __SCHEMA__.now_us(), 0), p_deadline_us);
  IF v_reply[1] = -2 THEN RETURN v_reply; END IF;
  RETURN v_reply[1:2] || v_reply[4:];
END $$;

-- A batch of rate checks in one call (version 6): checks that wait for the store at the same
-- moment, each decided by check_rate or settle_rate exactly as alone, in the order of their
-- first key and, for one key, as sent, so that two batches lock the keys they share in the same
-- order (a check's keys share its caller's prefix and sort together). Per check (1-based, as
-- sent): its algorithm, its number of limits, its cost and attempt, whether it is a
-- reservation, and, for a settlement, its reserved cost, the settled attempt and whether that
-- was a reservation (refundable) — a check has -1, 0 and false there (p_reserved NULL: none is
-- a settlement); per check its hold (version 9; µs, 0 or NULL: none; NULL: no check has one;
-- a settlement's is not read); p_keys, p_quotas, p_windows and p_blocks (each limit's penalty
-- in µs, 0 or NULL: none; NULL: no check has one) hold the checks' limits one after another;
-- p_retention_us: how long after the deadline a charged attempt is remembered. Returns, per
-- check in the order decided: its number, the length of its reply, then check_rate's (or
-- settle_rate's) reply.
CREATE OR REPLACE FUNCTION __SCHEMA__.decide_rates(
  p_algorithms smallint[], p_counts int[], p_keys text[], p_quotas bigint[],
  p_windows bigint[], p_blocks bigint[], p_costs bigint[], p_attempts bigint[],
  p_reservations boolean[],
  p_reserved bigint[], p_of bigint[], p_refundable boolean[], p_holds bigint[],
  p_retention_us bigint, p_deadline_us bigint
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
    IF coalesce(p_reserved[c], -1) >= 0 THEN
      v_reply := __SCHEMA__.settle_rate(p_algorithms[c], p_keys[v_first[c]:v_last],
        p_quotas[v_first[c]:v_last], p_windows[v_first[c]:v_last], p_reserved[c], p_costs[c],
        p_of[c], coalesce(p_refundable[c], false), p_attempts[c], p_retention_us,
        p_deadline_us);
    ELSE
      v_reply := __SCHEMA__.check_rate(p_algorithms[c], p_keys[v_first[c]:v_last],
        p_quotas[v_first[c]:v_last], p_windows[v_first[c]:v_last],
        p_blocks[v_first[c]:v_last], p_costs[c], p_attempts[c],
        coalesce(p_reservations[c], false), coalesce(p_holds[c], 0), p_retention_us,
        p_deadline_us);
    END IF;
    v_out := v_out || ARRAY[c, cardinality(v_reply)]::bigint[] || v_reply;
  END LOOP;
  RETURN v_out;
END $$;

-- decide_rates of versions 6 to 8, what their copies call: as above, holding nothing.
CREATE OR REPLACE FUNCTION __SCHEMA__.decide_rates(
  p_algorithms smallint[], p_counts int[], p_keys text[], p_quotas bigint[],
  p_windows bigint[], p_blocks bigint[], p_costs bigint[], p_attempts bigint[],
  p_reservations boolean[],
  p_reserved bigint[], p_of bigint[], p_refundable boolean[], p_retention_us bigint,
  p_deadline_us bigint
) RETURNS bigint[] LANGUAGE sql AS $$
  SELECT __SCHEMA__.decide_rates(p_algorithms, p_counts, p_keys, p_quotas, p_windows,
    p_blocks, p_costs, p_attempts, p_reservations, p_reserved, p_of, p_refundable,
    NULL::bigint[], p_retention_us, p_deadline_us)
$$;

-- decide_rates of version 5, what its copies call: as above, without penalties.
CREATE OR REPLACE FUNCTION __SCHEMA__.decide_rates(
  p_algorithms smallint[], p_counts int[], p_keys text[], p_quotas bigint[],
  p_windows bigint[], p_costs bigint[], p_attempts bigint[], p_reservations boolean[],
  p_reserved bigint[], p_of bigint[], p_refundable boolean[], p_retention_us bigint,
  p_deadline_us bigint
) RETURNS bigint[] LANGUAGE sql AS $$
  SELECT __SCHEMA__.decide_rates(p_algorithms, p_counts, p_keys, p_quotas, p_windows,
    NULL::bigint[], p_costs, p_attempts, p_reservations, p_reserved, p_of, p_refundable,
    p_retention_us, p_deadline_us)
$$;

-- decide_rates of version 4, what its copies call: as above, every check kept as a reservation
-- and every settlement refundable (version 4 refunded any), attempts remembered for twice the
-- time the call had left after its deadline; the replies without decided_at_us.
CREATE OR REPLACE FUNCTION __SCHEMA__.decide_rates(
  p_algorithms smallint[], p_counts int[], p_keys text[], p_quotas bigint[],
  p_windows bigint[], p_costs bigint[], p_attempts bigint[], p_reserved bigint[],
  p_of bigint[], p_deadline_us bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  v_all boolean[] := array_fill(true, ARRAY[coalesce(cardinality(p_algorithms), 0)]);
  v_in bigint[];
  v_out bigint[] := '{}';
  v_at int := 1;
  v_len int;
BEGIN
  v_in := __SCHEMA__.decide_rates(p_algorithms, p_counts, p_keys, p_quotas, p_windows, p_costs,
    p_attempts, v_all, p_reserved, p_of, v_all,
    2 * greatest(p_deadline_us - __SCHEMA__.now_us(), 0), p_deadline_us);
  -- per check: its number, its reply's length, its reply
  WHILE v_at < cardinality(v_in) LOOP
    v_len := v_in[v_at + 1];
    IF v_len > 2 THEN
      v_out := v_out || ARRAY[v_in[v_at], v_len - 1] || v_in[v_at + 2:v_at + 3]
        || v_in[v_at + 5:v_at + 1 + v_len];
    ELSE
      v_out := v_out || v_in[v_at:v_at + 1 + v_len];
    END IF;
    v_at := v_at + 2 + v_len;
  END LOOP;
  RETURN v_out;
END $$;

-- check_rates (version 3): a batch of checks without settlements, as decide_rates decides it;
-- what copies of version 3 call.
CREATE OR REPLACE FUNCTION __SCHEMA__.check_rates(
  p_algorithms smallint[], p_counts int[], p_keys text[], p_quotas bigint[],
  p_windows bigint[], p_costs bigint[], p_attempts bigint[], p_deadline_us bigint
) RETURNS bigint[] LANGUAGE sql AS $$
  SELECT __SCHEMA__.decide_rates(p_algorithms, p_counts, p_keys, p_quotas, p_windows, p_costs,
    p_attempts, NULL, NULL, p_deadline_us)
$$;

-- Several limits of one check (check_rate has locked their rows and read the clock, p_now): the
-- sliding log. Each limit's step first, charging nothing (a replay found in one log admits the
-- check: the limits after it decide nothing); then, the check admitted and costing, each log
-- charged as its step left it — every log, whatever the replay.
CREATE OR REPLACE FUNCTION __SCHEMA__.rate_sliding_log(
  p_keys text[], p_quotas bigint[], p_windows bigint[], p_cost bigint, p_attempt bigint,
  p_now bigint, p_hold bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  v_counts bigint[] := '{}';
  v_oldests bigint[] := '{}';
  v_limits bigint[] := '{}';
  v_admitted boolean := true;
  v_replay boolean := false;
  v_retry bigint := 0;
  v_row __SCHEMA__.rate_limits;
  v_step record;
BEGIN
  FOR i IN 1..cardinality(p_keys) LOOP
    SELECT * INTO v_row FROM __SCHEMA__.rate_limits WHERE key = p_keys[i];
    v_step := __SCHEMA__.rate_log_step(p_keys[i], v_row.a, v_row.expires_at, p_quotas[i],
      p_windows[i], p_cost, p_attempt, p_now, v_replay, false, p_hold);
    v_counts[i] := v_step.o_count;
    v_oldests[i] := v_step.o_oldest;
    v_limits := v_limits || ARRAY[v_step.o_remaining, v_step.o_reset];
    v_replay := v_step.o_replay;
    v_admitted := v_admitted AND v_step.o_admitted;
    v_retry := greatest(v_retry, v_step.o_retry);
  END LOOP;
  IF v_replay THEN
    v_admitted := true;
    v_retry := 0;
  END IF;
  IF v_admitted AND p_cost > 0 THEN
    FOR i IN 1..cardinality(p_keys) LOOP
      v_step := __SCHEMA__.rate_log_charge(p_keys[i], v_counts[i], v_oldests[i], p_quotas[i],
        p_windows[i], p_cost, p_attempt, p_now, p_hold);
      v_limits[2 * i - 1] := v_step.o_remaining;
      v_limits[2 * i] := v_step.o_reset;
    END LOOP;
  END IF;
  RETURN ARRAY[CASE WHEN v_admitted THEN 1 ELSE 0 END, v_retry] || v_limits;
END $$;

-- Several limits of one check, as rate_sliding_log: the sliding-window counter. (p_deadline is
-- unused: the signature is version 3's.)
CREATE OR REPLACE FUNCTION __SCHEMA__.rate_sliding_counter(
  p_keys text[], p_quotas bigint[], p_windows bigint[], p_cost bigint, p_attempt bigint,
  p_now bigint, p_deadline bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  v_rows __SCHEMA__.rate_limits[] := '{}';
  v_limits bigint[] := '{}';
  v_admitted boolean := true;
  v_retry bigint := 0;
  v_row __SCHEMA__.rate_limits;
  v_step bigint[];
BEGIN
  FOR i IN 1..cardinality(p_keys) LOOP
    SELECT * INTO v_row FROM __SCHEMA__.rate_limits WHERE key = p_keys[i];
    v_step := __SCHEMA__.rate_counter_step(p_keys[i], v_row.a, v_row.b, v_row.c,
      v_row.expires_at > p_now, p_quotas[i], p_windows[i], p_cost, p_now, false, NULL, 0);
    v_rows[i] := v_row;
    v_limits := v_limits || v_step[3:4];
    v_admitted := v_admitted AND v_step[1] = 1;
    v_retry := greatest(v_retry, v_step[2]);
  END LOOP;
  IF v_admitted AND p_cost > 0 THEN
    FOR i IN 1..cardinality(p_keys) LOOP
      v_row := v_rows[i];
      v_step := __SCHEMA__.rate_counter_step(p_keys[i], v_row.a, v_row.b, v_row.c,
        v_row.expires_at > p_now, p_quotas[i], p_windows[i], p_cost, p_now, true, v_row.born,
        p_attempt);
      v_limits[2 * i - 1:2 * i] := v_step[3:4];
    END LOOP;
  END IF;
  RETURN ARRAY[CASE WHEN v_admitted THEN 1 ELSE 0 END, v_retry] || v_limits;
END $$;

-- Several limits of one check, as rate_sliding_counter: GCRA, the check held for p_hold µs.
CREATE OR REPLACE FUNCTION __SCHEMA__.rate_gcra(
  p_keys text[], p_quotas bigint[], p_windows bigint[], p_cost bigint, p_attempt bigint,
  p_now bigint, p_deadline bigint, p_hold bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  v_rows __SCHEMA__.rate_limits[] := '{}';
  v_limits bigint[] := '{}';
  v_admitted boolean := true;
  v_retry bigint := 0;
  v_row __SCHEMA__.rate_limits;
  v_step bigint[];
BEGIN
  FOR i IN 1..cardinality(p_keys) LOOP
    SELECT * INTO v_row FROM __SCHEMA__.rate_limits WHERE key = p_keys[i];
    v_step := __SCHEMA__.rate_gcra_step(p_keys[i], v_row.a, v_row.b, v_row.expires_at > p_now,
      p_quotas[i], p_windows[i], p_cost, p_now, false, NULL, 0, p_hold);
    v_rows[i] := v_row;
    v_limits := v_limits || v_step[3:4];
    v_admitted := v_admitted AND v_step[1] = 1;
    v_retry := greatest(v_retry, v_step[2]);
  END LOOP;
  IF v_admitted AND p_cost > 0 THEN
    FOR i IN 1..cardinality(p_keys) LOOP
      v_row := v_rows[i];
      v_step := __SCHEMA__.rate_gcra_step(p_keys[i], v_row.a, v_row.b,
        v_row.expires_at > p_now, p_quotas[i], p_windows[i], p_cost, p_now, true, v_row.born,
        p_attempt, p_hold);
      v_limits[2 * i - 1:2 * i] := v_step[3:4];
    END LOOP;
  END IF;
  RETURN ARRAY[CASE WHEN v_admitted THEN 1 ELSE 0 END, v_retry] || v_limits;
END $$;

-- rate_sliding_log and rate_gcra as versions 3 to 8 called them: holding nothing.
CREATE OR REPLACE FUNCTION __SCHEMA__.rate_sliding_log(
  p_keys text[], p_quotas bigint[], p_windows bigint[], p_cost bigint, p_attempt bigint,
  p_now bigint
) RETURNS bigint[] LANGUAGE sql AS $$
  SELECT __SCHEMA__.rate_sliding_log(p_keys, p_quotas, p_windows, p_cost, p_attempt, p_now,
    0::bigint)
$$;
CREATE OR REPLACE FUNCTION __SCHEMA__.rate_gcra(
  p_keys text[], p_quotas bigint[], p_windows bigint[], p_cost bigint, p_attempt bigint,
  p_now bigint, p_deadline bigint
) RETURNS bigint[] LANGUAGE sql AS $$
  SELECT __SCHEMA__.rate_gcra(p_keys, p_quotas, p_windows, p_cost, p_attempt, p_now,
    p_deadline, 0::bigint)
$$;

-- ---------------------------------------------------------------------------------------------
-- settle_rate: a settlement (mirrors a settlement in scripts/rate.lua) corrects what the
-- admitted attempt p_of charged, p_reserved, to its actual cost p_actual on every limit of a
-- policy, in one step (see settle_limit). An overrun (p_actual > p_reserved) is charged now,
-- whatever the balance. A refund is made only when p_refundable (p_of was a reservation), and
-- only of what each limit still counts of p_of's charge: from its log entries, or at the place
-- its ledger row keeps; the place is then dropped, so that nothing refunds it twice. Always
-- admitted. The settlement is an attempt of its own (p_attempt), remembered in the ledger as a
-- charged check is (until p_deadline_us + p_retention_us): re-sent, or made again, it changes
-- nothing. Locks the rows as check_rate does. Returns check_rate's reply for the limits as
-- they stand after it, or {-2, 0} when received late.
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION __SCHEMA__.settle_rate(
  p_algorithm smallint, p_keys text[], p_quotas bigint[], p_windows bigint[],
  p_reserved bigint, p_actual bigint, p_of bigint, p_refundable boolean, p_attempt bigint,
  p_retention_us bigint, p_deadline_us bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint;
  v_row __SCHEMA__.rate_limits;
  v_replay boolean;
  v_delta bigint := p_actual - p_reserved;
  -- the numbers of a place per limit
  v_width int := CASE p_algorithm WHEN 2 THEN 2 WHEN 3 THEN 3 ELSE 0 END;
  v_place bigint[];
  v_limits bigint[] := '{}';
BEGIN
  IF __SCHEMA__.now_us() >= p_deadline_us THEN RETURN ARRAY[-2, 0]; END IF;
  PERFORM __SCHEMA__.lock_rate_rows(p_keys);
  v_now := __SCHEMA__.now_us();
  IF v_now >= p_deadline_us THEN RETURN ARRAY[-2, 0]; END IF;
  SELECT * INTO v_row FROM __SCHEMA__.rate_limits WHERE key = p_keys[1];
  -- an expired row remembers nothing
  IF v_row.expires_at <= v_now THEN v_row.recent := '{}'; v_row.recent_until := '{}'; END IF;
  v_replay := __SCHEMA__.remembered(p_keys[1], p_attempt, v_now, v_row.recent,
    v_row.recent_until);
  IF v_replay OR (v_delta < 0 AND NOT p_refundable) THEN
    v_delta := 0;
  ELSIF v_delta < 0 AND v_width > 0 THEN
    SELECT place INTO v_place FROM __SCHEMA__.rate_attempts
      WHERE key = p_keys[1] AND attempt = p_of AND expires_at > v_now AND place_until > v_now;
    -- a place kept for other limits than these places nothing, nor one of an earlier version
    -- (without the lives it charged)
    IF cardinality(v_place) <> v_width * cardinality(p_keys) THEN v_place := NULL; END IF;
  END IF;
  FOR i IN 1..cardinality(p_keys) LOOP
    SELECT * INTO v_row FROM __SCHEMA__.rate_limits WHERE key = p_keys[i];
    v_limits := v_limits || __SCHEMA__.settle_limit(p_algorithm, v_row, p_quotas[i],
      p_windows[i], v_delta, v_place[v_width * (i - 1) + 1:v_width * i], p_of, p_attempt,
      v_now);
  END LOOP;
  IF NOT v_replay THEN
    UPDATE __SCHEMA__.rate_attempts SET place = NULL, place_until = 0
      WHERE key = p_keys[1] AND attempt = p_of AND place IS NOT NULL;
    PERFORM __SCHEMA__.remember_attempt(p_keys[1], p_attempt, p_deadline_us + p_retention_us,
      NULL, 0);
  END IF;
  RETURN ARRAY[1, 0, v_now] || v_limits;
END $$;

-- One limit of a settlement: moves what row p_row has charged by p_delta (0 changes nothing),
-- under p_algorithm, and answers the limit's remaining and reset_us as its step does.
-- An overrun (p_delta > 0) is charged now, past the quota by at most one more quota: the log
-- logs it as the settlement's own entry (p_attempt), scored now; the counter adds it to the
-- current window; GCRA moves the arrival time on.
-- A refund (p_delta < 0) returns at most -p_delta, and only what the limit still counts of the
-- settled attempt p_of's charge: the log from p_of's entry (what is left of it in the window);
-- the counter from the window p_place[1] it was added to — the current window (up to its
-- count), or the previous one (up to its count, and the estimate falls by the share of it
-- still inside the sliding window), nothing from an older one; GCRA up to the part of p_of's
-- span still ahead of now (its end: p_place[1], p_place[2]), at most the current offset.
-- A counter or GCRA limit refunds only while the row lives in the life p_of charged (p_place's
-- last number), and nothing without a place (p_place NULL). An overrun that finds no life
-- living begins one, named p_attempt.
CREATE OR REPLACE FUNCTION __SCHEMA__.settle_limit(
  p_algorithm smallint, p_row __SCHEMA__.rate_limits, p_quota bigint, p_window bigint,
  p_delta bigint, p_place bigint[], p_of bigint, p_attempt bigint, p_now bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  v_live boolean := p_row.expires_at > p_now;
  v_log record;
  v_moved bigint;
  v_cost bigint;
  w double precision := p_window / 1000.0;
  idx bigint;
  cur bigint := 0;
  prev bigint := 0;
  v_was bigint[];
  ahead bigint;
  v_ahead bigint;
  v_span bigint;
  tat bigint := p_now;
  rem bigint := 0;
  v_born bigint;
BEGIN
  -- past the quota by at most one more: a larger difference moves nothing further
  p_delta := least(p_delta, 2 * p_quota);
  IF p_algorithm = 1 THEN
    v_log := __SCHEMA__.rate_log_step(p_row.key, p_row.a, p_row.expires_at, p_quota, p_window,
      0, p_of, p_now, false, false, 0);
    IF p_delta > 0 THEN
      v_moved := least(p_delta, greatest(2 * p_quota - v_log.o_count, 0));
      IF v_moved > 0 THEN
        INSERT INTO __SCHEMA__.rate_log (key, attempt, score, cost)
          VALUES (p_row.key, p_attempt, p_now, v_moved) ON CONFLICT DO NOTHING;
        -- an expiry that a held entry set stays
        UPDATE __SCHEMA__.rate_limits
          SET a = v_log.o_count + v_moved,
              expires_at = greatest(expires_at,
                p_now + __SCHEMA__.ceil_div(p_window, 1000) * 1000),
              purge_at = __SCHEMA__.purge_mark(purge_at, greatest(expires_at,
                p_now + __SCHEMA__.ceil_div(p_window, 1000) * 1000), p_window)
          WHERE key = p_row.key;
      END IF;
    ELSIF p_delta < 0 THEN
      SELECT cost INTO v_cost FROM __SCHEMA__.rate_log WHERE key = p_row.key AND attempt = p_of;
      v_moved := -least(coalesce(v_cost, 0), -p_delta);
      IF v_cost IS NOT NULL THEN
        IF v_cost + v_moved > 0 THEN
          UPDATE __SCHEMA__.rate_log SET cost = cost + v_moved
            WHERE key = p_row.key AND attempt = p_of;
        ELSE
          DELETE FROM __SCHEMA__.rate_log WHERE key = p_row.key AND attempt = p_of;
        END IF;
        UPDATE __SCHEMA__.rate_limits SET a = v_log.o_count + v_moved WHERE key = p_row.key;
      END IF;
    END IF;
    v_log := __SCHEMA__.rate_log_step(p_row.key, v_log.o_count + coalesce(v_moved, 0),
      p_now + 1, p_quota, p_window, 0, p_of, p_now, false, false, 0);
    RETURN ARRAY[v_log.o_remaining, v_log.o_reset];
  ELSIF p_algorithm = 2 THEN
    idx := __SCHEMA__.counter_window(p_now, p_window);
    IF v_live AND p_row.a = idx THEN cur := p_row.b; prev := p_row.c; v_born := p_row.born;
    ELSIF v_live AND p_row.a = idx - 1 THEN prev := p_row.b; v_born := p_row.born; END IF;
    v_was := ARRAY[cur, prev];
    IF p_delta > 0 THEN
      cur := least(cur + p_delta, greatest(cur, 2 * p_quota));
    ELSIF p_delta < 0 AND p_place[2] = v_born AND p_place[1] = idx THEN
      cur := cur - least(-p_delta, cur);
    ELSIF p_delta < 0 AND p_place[2] = v_born AND p_place[1] = idx - 1 THEN
      prev := prev - least(-p_delta, prev);
    END IF;
    IF ARRAY[cur, prev] <> v_was THEN
      -- as of the current window; a new one moves the expiry to the end of the next
      UPDATE __SCHEMA__.rate_limits
        SET a = idx, b = cur, c = prev, born = coalesce(v_born, p_attempt),
            expires_at = CASE WHEN v_live AND p_row.a = idx THEN expires_at ELSE
              (p_now / 1000) * 1000 + ceil(2 * w - ((p_now / 1000) - idx * w))::bigint * 1000
            END,
            purge_at = __SCHEMA__.purge_mark(purge_at, (p_now / 1000) * 1000
              + ceil(2 * w - ((p_now / 1000) - idx * w))::bigint * 1000, p_window)
        WHERE key = p_row.key;
    END IF;
    RETURN (__SCHEMA__.rate_counter_step(p_row.key, idx, cur, prev, true, p_quota, p_window, 0,
      p_now, false, NULL, 0))[3:4];
  END IF;
  IF v_live AND p_row.a >= p_now THEN tat := p_row.a; rem := p_row.b; v_born := p_row.born; END IF;
  ahead := (tat - p_now) * p_quota + rem;
  v_ahead := ahead;
  IF p_delta > 0 THEN
    ahead := least(ahead + p_delta * p_window, greatest(ahead, 2 * p_window * p_quota));
  ELSIF p_delta < 0 AND cardinality(p_place) = 3 AND p_place[3] = v_born THEN
    -- in 1/quota µs: what of the charge's span is still ahead of now
    v_span := greatest(0, (p_place[1] - p_now) * p_quota + p_place[2]);
    ahead := ahead - least(-p_delta * p_window, v_span, ahead);
  END IF;
  IF ahead <> v_ahead THEN
    tat := p_now + ahead / p_quota;
    rem := ahead % p_quota;
    UPDATE __SCHEMA__.rate_limits
      SET a = tat, b = rem, born = coalesce(v_born, p_attempt),
          expires_at = p_now + (__SCHEMA__.ceil_div(tat - p_now, 1000) + 1) * 1000,
          purge_at = __SCHEMA__.purge_mark(purge_at,
            p_now + (__SCHEMA__.ceil_div(tat - p_now, 1000) + 1) * 1000, p_window)
      WHERE key = p_row.key;
  END IF;
  RETURN (__SCHEMA__.rate_gcra_step(p_row.key, tat, rem, true, p_quota, p_window, 0, p_now,
    false, NULL, 0, 0))[3:4];
END $$;

-- reset_rate: deletes a caller's limits (and their logs), locking them in key order as
-- check_rate does, and notifies p_payload on p_channel (sent when the transaction commits). The
-- attempts remembered under them stay, as they do on every store: an attempt that charged
-- before the reset and is re-sent after it charges nothing. Received at or after p_deadline_us
-- (version 9; read once the rows are locked), it deletes nothing and notifies nothing: a reset
-- that timed out has then either run by its deadline or never will, and cannot land later to
-- erase what was charged since. Returns the number of rows deleted, or -1 when received late.
CREATE OR REPLACE FUNCTION __SCHEMA__.reset_rate(
  p_keys text[], p_channel text, p_payload text, p_deadline_us bigint
) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
  v_deleted bigint;
BEGIN
  IF __SCHEMA__.now_us() >= p_deadline_us THEN RETURN -1; END IF;
  PERFORM 1 FROM __SCHEMA__.rate_limits WHERE key = ANY (p_keys) ORDER BY key FOR UPDATE;
  IF __SCHEMA__.now_us() >= p_deadline_us THEN RETURN -1; END IF;
  DELETE FROM __SCHEMA__.rate_limits WHERE key = ANY (p_keys);
  GET DIAGNOSTICS v_deleted = ROW_COUNT;
  PERFORM pg_notify(p_channel, p_payload);
  RETURN v_deleted;
END $$;

-- reset_rate of versions 1 to 8, what their copies call: without a deadline.
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

-- Draws the next fencing token of p_fence_key at p_now: above both the counter's last value (while
-- it lives) and the store time in µs, so that a counter lost or restored stale cannot repeat one;
-- the counter then lives p_ttl_ms. For lock_acquire and permit_acquire, under their key's lock.
CREATE OR REPLACE FUNCTION __SCHEMA__.draw_fence(p_fence_key text, p_now bigint, p_ttl_ms bigint)
RETURNS bigint LANGUAGE sql VOLATILE AS $$
  INSERT INTO __SCHEMA__.fences AS f (key, last, expires_at)
    VALUES (p_fence_key, p_now, p_now + p_ttl_ms * 1000)
    ON CONFLICT (key) DO UPDATE
      SET last = CASE WHEN f.expires_at > p_now AND f.last >= p_now THEN f.last + 1
                      ELSE p_now END,
          expires_at = EXCLUDED.expires_at
    RETURNING last
$$;

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
  o_value := __SCHEMA__.draw_fence(p_fence_key, v_now, p_fence_ttl_ms);
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
  o_value := __SCHEMA__.draw_fence(p_fence_key, v_now, p_fence_ttl_ms);
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
-- the queue, if it waits), leaving a marker naming this release call (p_call) under
-- `<key> <token>`, so that the call re-sent answers true again. (as permit_release.lua)
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
    INSERT INTO __SCHEMA__.idempotency
        (key, done, fingerprint, token, response, expires_at, created_at)
      VALUES (p_key, false, p_fingerprint, p_token, NULL, v_now + p_lease_ms * 1000, v_now)
      ON CONFLICT (key) DO UPDATE
        SET done = false, fingerprint = EXCLUDED.fingerprint, token = EXCLUDED.token,
            response = NULL, expires_at = EXCLUDED.expires_at,
            created_at = EXCLUDED.created_at;
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
  t text;
BEGIN
  o_most := 0;
  o_total := 0;
  -- in the lock order; rate_limits by its purge mark, the others by their expiry
  FOREACH t IN ARRAY ARRAY['rate_limits', 'rate_attempts', 'holds', 'permits', 'permit_queue',
                           'fences', 'idempotency', 'releases', 'once_records'] LOOP
    EXECUTE format(
      'DELETE FROM %s.%I WHERE ctid = ANY (ARRAY('
      '  SELECT ctid FROM %s.%I WHERE %I <= $1 LIMIT $2 FOR UPDATE SKIP LOCKED))',
      '__SCHEMA__', t, '__SCHEMA__', t,
      CASE t WHEN 'rate_limits' THEN 'purge_at' ELSE 'expires_at' END
    ) USING v_now, p_limit;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    o_most := greatest(o_most, v_count); o_total := o_total + v_count;
  END LOOP;
END $$;
