-- Version 10: each rate-limit layer's limits in force (limit_tables: one row per namespace, its
-- version raised by one at each save) and their history (limit_changes: the newest
-- `p_kept` changes of each). Lock order: after every table of the base, limit_tables, then
-- limit_changes. Nothing of the base changes: copies of version 9 keep working on a schema of
-- version 10.

CREATE TABLE IF NOT EXISTS __SCHEMA__.limit_tables (
  namespace text PRIMARY KEY,
  version bigint NOT NULL,
  doc text NOT NULL
);

CREATE TABLE IF NOT EXISTS __SCHEMA__.limit_changes (
  namespace text NOT NULL,
  version bigint NOT NULL,
  at_ms bigint NOT NULL,
  note text NOT NULL,
  doc text NOT NULL,
  PRIMARY KEY (namespace, version)
);

-- Saves table p_doc of p_namespace as version p_expected + 1, only if the table's version is
-- p_expected (0: none yet), and keeps the change with p_note; at most p_kept changes stay.
-- Returns {1, version} when saved, {0, version held} when not, {-1, 0} when received at or
-- after p_deadline_us (database clock): then it changes nothing. Of two saves that read one
-- version, the second waits for the first's row lock (or, for a first table, its primary key)
-- and then finds the version raised.
CREATE OR REPLACE FUNCTION __SCHEMA__.limits_save(
  p_namespace text, p_expected bigint, p_doc text, p_note text, p_kept integer,
  p_deadline_us bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  v_held bigint;
  v_now bigint;
BEGIN
  SELECT version INTO v_held FROM __SCHEMA__.limit_tables
    WHERE namespace = p_namespace FOR UPDATE;
  v_held := coalesce(v_held, 0);
  v_now := __SCHEMA__.now_us();
  IF v_now >= p_deadline_us THEN RETURN ARRAY[-1, 0]; END IF;
  IF v_held <> p_expected THEN RETURN ARRAY[0, v_held]; END IF;
  IF v_held = 0 THEN
    INSERT INTO __SCHEMA__.limit_tables (namespace, version, doc) VALUES (p_namespace, 1, p_doc)
      ON CONFLICT (namespace) DO NOTHING;
    IF NOT FOUND THEN
      -- another save made the first table meanwhile
      SELECT version INTO v_held FROM __SCHEMA__.limit_tables WHERE namespace = p_namespace;
      RETURN ARRAY[0, v_held];
    END IF;
  ELSE
    UPDATE __SCHEMA__.limit_tables SET version = v_held + 1, doc = p_doc
      WHERE namespace = p_namespace;
  END IF;
  INSERT INTO __SCHEMA__.limit_changes (namespace, version, at_ms, note, doc)
    VALUES (p_namespace, v_held + 1, v_now / 1000, p_note, p_doc);
  DELETE FROM __SCHEMA__.limit_changes
    WHERE namespace = p_namespace AND version <= v_held + 1 - p_kept;
  RETURN ARRAY[1, v_held + 1];
END $$;

-- The copies of each layer that registered themselves (limits_register): what each was built
-- with, and until when it counts as alive (database clock, µs). Lock order: after
-- limit_changes.
CREATE TABLE IF NOT EXISTS __SCHEMA__.limit_copies (
  namespace text NOT NULL,
  copy text NOT NULL,
  built text NOT NULL,
  until_us bigint NOT NULL,
  PRIMARY KEY (namespace, copy)
);

-- Registers copy p_copy of the layer of p_namespace, built with p_built, alive for p_ttl_ms
-- more; drops the copies of the layer whose time is over.
CREATE OR REPLACE FUNCTION __SCHEMA__.limits_register(
  p_namespace text, p_copy text, p_built text, p_ttl_ms bigint
) RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := __SCHEMA__.now_us();
BEGIN
  DELETE FROM __SCHEMA__.limit_copies WHERE namespace = p_namespace AND until_us <= v_now;
  INSERT INTO __SCHEMA__.limit_copies (namespace, copy, built, until_us)
    VALUES (p_namespace, p_copy, p_built, v_now + p_ttl_ms * 1000)
    ON CONFLICT (namespace, copy) DO UPDATE SET built = EXCLUDED.built, until_us = EXCLUDED.until_us;
  RETURN 1;
END $$;
