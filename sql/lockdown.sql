-- pgoutbox lockdown (`pgoutbox setup --lockdown`; PostgreSQL 14+, tested on 15): after it,
-- the only way for a role other than a superuser to write an outbox message is
-- outbox.emit / outbox.emit_bytes, and every message they write names its emitter
-- (session_user).
--
-- This file is the first of the lockdown's two steps; run it through
-- `pgoutbox setup --lockdown`, as a superuser: only the owner of
-- pg_catalog.pg_logical_emit_message (the bootstrap superuser) or a superuser may change
-- its privileges. It is per database: privileges on functions live in each database's
-- pg_proc, so this applies to the database it runs in only.
--
-- Step 1 (this file, one transaction, after sql/outbox.sql):
--   1. creates the NOLOGIN role pgoutbox_emitter (roles are cluster-wide: it may exist);
--   2. REVOKEs EXECUTE on every overload of pg_catalog.pg_logical_emit_message from PUBLIC
--      (found in pg_proc by name: PostgreSQL 17 adds one with a flush argument) and GRANTs
--      it to pgoutbox_emitter;
--   3. gives pgoutbox_emitter everything the helpers run or trust, so that no login role
--      but a superuser can change, drop or shadow it: the schema outbox (a schema's owner
--      may drop any object in it, and the helpers call outbox._envelope by name), the
--      functions outbox.emit, outbox.emit_bytes and outbox._envelope, the table
--      outbox.idempotency (its owner could add a trigger, which would run as the emitter)
--      and the table outbox.lockdown (the record the streamer trusts);
--   4. makes outbox.emit / outbox.emit_bytes SECURITY DEFINER (their search_path is pinned
--      to pg_catalog, pg_temp and every name outside pg_catalog is schema-qualified, see
--      sql/outbox.sql; pg_temp is never searched for functions or operators);
--      (the schema's owner before keeps USAGE on it, so that its producers still emit);
--   5. writes the record (outbox.lockdown) with enabled_at_lsn NULL: pending, and the
--      previous owners (unlock gives the objects back to them).
-- Step 2 (src/admin/lockdown.rs, after this commits): waits until every transaction that
-- was running when the REVOKE committed has ended (PostgreSQL checks EXECUTE when a query
-- starts: a cursor declared before the REVOKE still calls pg_logical_emit_message after
-- it), then, in a new transaction, writes the lockdown marker, a transactional logical
-- message with prefix pgoutbox.lockdown and content 'on', and records its LSN in
-- outbox.lockdown.enabled_at_lsn, and the fingerprint of the helpers' definitions. Only
-- then does the streamer check emitters: every pgoutbox message after that LSN was written
-- by a transaction that began after the REVOKE was visible, so through the helpers (or by
-- a superuser); one that is not a version-2 (or later) envelope with an emitter is
-- dead-lettered as forged (see src/lockdown.rs).
--
-- Idempotent: running it again changes nothing and keeps the first record (and LSN).
-- Superusers can still call pg_logical_emit_message, and write any envelope at all.
-- Undo with sql/unlock.sql (`pgoutbox setup --unlock`).

DO $lockdown$
DECLARE
    f regprocedure;
    owners jsonb;
BEGIN
    -- One lockdown or unlock at a time.
    LOCK TABLE outbox.lockdown IN EXCLUSIVE MODE;

    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'pgoutbox_emitter') THEN
        BEGIN
            CREATE ROLE pgoutbox_emitter NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL; -- created meanwhile by a lockdown of another database
        END;
    END IF;
    COMMENT ON ROLE pgoutbox_emitter IS
        'pgoutbox: NOLOGIN owner of schema outbox and of the helpers under setup --lockdown; the only non-superuser role that may call pg_logical_emit_message';

    FOR f IN
        SELECT p.oid::regprocedure
          FROM pg_catalog.pg_proc p
         WHERE p.proname = 'pg_logical_emit_message'
           AND p.pronamespace = 'pg_catalog'::regnamespace
    LOOP
        EXECUTE pg_catalog.format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO pgoutbox_emitter', f);
    END LOOP;

    -- Who owned what before (kept from the first lockdown: unlock gives them back).
    owners := pg_catalog.jsonb_build_object(
        'schema', (SELECT pg_catalog.pg_get_userbyid(nspowner) FROM pg_catalog.pg_namespace
                    WHERE nspname = 'outbox'),
        'emit', (SELECT pg_catalog.pg_get_userbyid(proowner) FROM pg_catalog.pg_proc
                  WHERE oid = 'outbox.emit(text, jsonb, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text, text)'::regprocedure),
        '_envelope', (SELECT pg_catalog.pg_get_userbyid(proowner) FROM pg_catalog.pg_proc
                       WHERE oid = 'outbox._envelope(text, bytea, text, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text)'::regprocedure),
        'idempotency', (SELECT pg_catalog.pg_get_userbyid(relowner) FROM pg_catalog.pg_class
                         WHERE oid = 'outbox.idempotency'::regclass),
        'lockdown', (SELECT pg_catalog.pg_get_userbyid(relowner) FROM pg_catalog.pg_class
                      WHERE oid = 'outbox.lockdown'::regclass));

    ALTER SCHEMA outbox OWNER TO pgoutbox_emitter;
    -- Its owner before keeps what its producers need (USAGE), not CREATE.
    IF owners ->> 'schema' <> 'pgoutbox_emitter' THEN
        EXECUTE pg_catalog.format('GRANT USAGE ON SCHEMA outbox TO %I', owners ->> 'schema');
    END IF;
    ALTER FUNCTION outbox._envelope(text, bytea, text, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text) OWNER TO pgoutbox_emitter;
    ALTER FUNCTION outbox.emit(text, jsonb, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text, text) OWNER TO pgoutbox_emitter;
    ALTER FUNCTION outbox.emit(text, jsonb, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text, text) SECURITY DEFINER;
    ALTER FUNCTION outbox.emit_bytes(text, bytea, text, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text, text) OWNER TO pgoutbox_emitter;
    ALTER FUNCTION outbox.emit_bytes(text, bytea, text, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text, text) SECURITY DEFINER;
    ALTER TABLE outbox.idempotency OWNER TO pgoutbox_emitter;
    ALTER TABLE outbox.lockdown OWNER TO pgoutbox_emitter;

    IF NOT EXISTS (SELECT 1 FROM outbox.lockdown) THEN
        INSERT INTO outbox.lockdown (enabled_at_lsn, previous_owner, previous_owners)
        VALUES (NULL, owners ->> 'emit', owners);
    END IF;
END;
$lockdown$;
