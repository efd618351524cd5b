-- pgoutbox unlock (`pgoutbox setup --unlock`): undoes sql/lockdown.sql in this database.
--
-- Run in one transaction, as a superuser. GRANTs EXECUTE on every overload of
-- pg_catalog.pg_logical_emit_message back to PUBLIC (the default) and revokes
-- pgoutbox_emitter's own grant, makes outbox.emit / outbox.emit_bytes SECURITY INVOKER
-- again, gives the schema, the helpers and the tables sql/lockdown.sql took back to their
-- owners before the lockdown (when those roles still exist), deletes
-- the outbox.lockdown record and writes the marker 'off' (prefix pgoutbox.lockdown), after
-- which the streamer checks no emitter any more. The role pgoutbox_emitter is kept: it is
-- cluster-wide and may serve the lockdown of another database.
--
-- Idempotent: without a lockdown record it only re-asserts the default privileges.

DO $unlock$
DECLARE
    f      regprocedure;
    prev   text;
    owners jsonb;
    lsn    pg_lsn;
    what   text;
    stmt   text;
BEGIN
    LOCK TABLE outbox.lockdown IN EXCLUSIVE MODE;

    FOR f IN
        SELECT p.oid::regprocedure
          FROM pg_catalog.pg_proc p
         WHERE p.proname = 'pg_logical_emit_message'
           AND p.pronamespace = 'pg_catalog'::regnamespace
    LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO PUBLIC', f);
        IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'pgoutbox_emitter') THEN
            EXECUTE pg_catalog.format('REVOKE EXECUTE ON FUNCTION %s FROM pgoutbox_emitter', f);
        END IF;
    END LOOP;

    ALTER FUNCTION outbox.emit(text, jsonb, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text, text) SECURITY INVOKER;
    ALTER FUNCTION outbox.emit_bytes(text, bytea, text, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text, text) SECURITY INVOKER;

    DELETE FROM outbox.lockdown RETURNING previous_owner, previous_owners, enabled_at_lsn
        INTO prev, owners, lsn;
    IF FOUND THEN
        owners := coalesce(owners, pg_catalog.jsonb_build_object('emit', prev, '_envelope', prev));
        -- Each object back to its owner before the lockdown, when that role still exists.
        FOR what, stmt IN VALUES
            ('schema', 'ALTER SCHEMA outbox OWNER TO %I'),
            ('emit', 'ALTER FUNCTION outbox.emit(text, jsonb, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text, text) OWNER TO %I'),
            ('emit', 'ALTER FUNCTION outbox.emit_bytes(text, bytea, text, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text, text) OWNER TO %I'),
            ('_envelope', 'ALTER FUNCTION outbox._envelope(text, bytea, text, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text) OWNER TO %I'),
            ('idempotency', 'ALTER TABLE outbox.idempotency OWNER TO %I'),
            ('lockdown', 'ALTER TABLE outbox.lockdown OWNER TO %I')
        LOOP
            prev := owners ->> what;
            IF prev IS NOT NULL AND prev <> 'pgoutbox_emitter'
               AND EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = prev) THEN
                EXECUTE pg_catalog.format(stmt, prev);
            END IF;
        END LOOP;
        -- A pending lockdown (step 2 never ran) wrote no marker: nothing to lift.
        IF lsn IS NOT NULL THEN
            PERFORM pg_catalog.pg_logical_emit_message(true, 'pgoutbox.lockdown', 'off');
        END IF;
    END IF;
END;
$unlock$;
