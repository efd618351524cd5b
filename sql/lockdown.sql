-- pgoutbox lockdown (`pgoutbox setup --lockdown`; PostgreSQL 14+, tested on 15): after it,
-- the only way for an ordinary role to write an outbox message is outbox.emit /
-- outbox.emit_bytes, and every message they write names its emitter (session_user).
--
-- Run after sql/outbox.sql, in one transaction, as a superuser: only the owner of
-- pg_catalog.pg_logical_emit_message (the bootstrap superuser) or a superuser may change its
-- privileges. It is per database: privileges on functions live in each database's pg_proc,
-- so this applies to the database it runs in only.
--
-- What it does:
--   1. creates the NOLOGIN role pgoutbox_emitter (roles are cluster-wide: it may exist);
--   2. REVOKEs EXECUTE on every overload of pg_catalog.pg_logical_emit_message from PUBLIC
--      (found in pg_proc by name: PostgreSQL 17 adds one with a flush argument) and GRANTs
--      it to pgoutbox_emitter;
--   3. makes outbox.emit / outbox.emit_bytes SECURITY DEFINER functions owned by
--      pgoutbox_emitter (their search_path is pinned to pg_catalog, pg_temp and every name
--      in them is schema-qualified, see sql/outbox.sql);
--   4. writes the lockdown marker, a transactional logical message with prefix
--      pgoutbox.lockdown and content 'on', and records its LSN in outbox.lockdown: the
--      streamer dead-letters, as forged, every pgoutbox message after that LSN that is not a
--      version-2 envelope with an emitter (see src/lockdown.rs for why this is exact).
--
-- Idempotent: running it again changes nothing and keeps the first record (and LSN).
-- Superusers can still call pg_logical_emit_message, and write any envelope at all.
-- Undo with sql/unlock.sql (`pgoutbox setup --unlock`).

DO $lockdown$
DECLARE
    f regprocedure;
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
        'pgoutbox: NOLOGIN owner of outbox.emit / outbox.emit_bytes under setup --lockdown; the only non-superuser role that may call pg_logical_emit_message';
    GRANT USAGE ON SCHEMA outbox TO pgoutbox_emitter;
    GRANT EXECUTE ON FUNCTION outbox._envelope(text, bytea, text, jsonb, text, text) TO pgoutbox_emitter;

    FOR f IN
        SELECT p.oid::regprocedure
          FROM pg_catalog.pg_proc p
         WHERE p.proname = 'pg_logical_emit_message'
           AND p.pronamespace = 'pg_catalog'::regnamespace
    LOOP
        EXECUTE pg_catalog.format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO pgoutbox_emitter', f);
    END LOOP;

    IF NOT EXISTS (SELECT 1 FROM outbox.lockdown) THEN
        INSERT INTO outbox.lockdown (enabled_at_lsn, previous_owner)
        VALUES (
            pg_catalog.pg_logical_emit_message(true, 'pgoutbox.lockdown', 'on'),
            (SELECT pg_catalog.pg_get_userbyid(proowner) FROM pg_catalog.pg_proc
              WHERE oid = 'outbox.emit(text, jsonb, jsonb, text, text)'::regprocedure));
    END IF;

    ALTER FUNCTION outbox.emit(text, jsonb, jsonb, text, text) OWNER TO pgoutbox_emitter;
    ALTER FUNCTION outbox.emit(text, jsonb, jsonb, text, text) SECURITY DEFINER;
    ALTER FUNCTION outbox.emit_bytes(text, bytea, text, jsonb, text, text) OWNER TO pgoutbox_emitter;
    ALTER FUNCTION outbox.emit_bytes(text, bytea, text, jsonb, text, text) SECURITY DEFINER;
END;
$lockdown$;
