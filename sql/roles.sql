-- pgoutbox least-privilege roles. `pgoutbox setup --create-roles` runs this file (with
-- --streamer-role / --producer-role as the names); with psql run it after `pgoutbox setup`,
-- as a superuser, in the database that holds the outbox:
--
--   psql -v ON_ERROR_STOP=1 -d app -f sql/roles.sql
--
-- Idempotent: a role that exists is kept as it is (its attributes are not changed), and
-- the grants are given again. Roles are cluster-wide, the grants are per database: run it
-- in every database with an outbox.
--
-- The streamer role (default pgoutbox_streamer): LOGIN REPLICATION, not a superuser, and
-- exactly what `pgoutbox run` touches:
--   * the slot, over the replication protocol (IDENTIFY_SYSTEM, SHOW, START_REPLICATION):
--     the REPLICATION attribute;
--   * its SQL session: pg_replication_slots, pg_stat_replication, pg_publication, pg_roles,
--     pg_settings / current_setting() and pg_current_wal_lsn(), all readable by every role;
--   * dead letters: INSERT on outbox.dead_letter, SELECT on it (the insert's
--     ON CONFLICT (lsn) check reads it), USAGE on its id sequence, USAGE on schema outbox;
--   * the slot's history: SELECT, INSERT, UPDATE on outbox.stream_state (the last flush LSN
--     it reported, see `run`'s gap check);
--   * retention and the journal: SELECT, DELETE on outbox.idempotency (old keys) and
--     SELECT, INSERT, DELETE on outbox.journal (`run --journal`, `--journal-retention`);
--   * CONNECT on the database (PUBLIC has it by default; granted in case it was revoked).
-- No password is set here: give one with ALTER ROLE pgoutbox_streamer PASSWORD '...' (from
-- psql: \password pgoutbox_streamer), or authenticate it with a client certificate
-- (pg_hba.conf `hostssl ... cert`).
--
-- The producer role (default pgoutbox_producer): NOLOGIN, a group role to grant to the
-- application's own login roles (GRANT pgoutbox_producer TO app_user): USAGE on schema
-- outbox, EXECUTE on outbox.emit and outbox.emit_bytes and INSERT on outbox.idempotency
-- (for emits with an idempotency_key), nothing more (it cannot read outbox.dead_letter or
-- the idempotency keys). EXECUTE on functions is also PUBLIC's by default in PostgreSQL;
-- `pgoutbox setup --lockdown` is what takes the direct path (pg_logical_emit_message) away.
--
-- Creating a role with REPLICATION needs a superuser (PostgreSQL 15).

CREATE OR REPLACE FUNCTION pg_temp.pgoutbox_create_roles(streamer name, producer name)
RETURNS text LANGUAGE plpgsql AS $fn$
DECLARE
    created text[] := '{}';
BEGIN
    IF streamer = producer THEN
        RAISE EXCEPTION 'the streamer and the producer role must differ (both are %)', streamer;
    END IF;
    IF to_regclass('outbox.dead_letter') IS NULL THEN
        RAISE EXCEPTION 'schema outbox is not installed in database %: run pgoutbox setup first', current_database();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = streamer) THEN
        BEGIN
            EXECUTE format('CREATE ROLE %I LOGIN REPLICATION NOSUPERUSER NOCREATEDB NOCREATEROLE', streamer);
            created := created || streamer::text;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL; -- created meanwhile by another session
        END;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = producer) THEN
        BEGIN
            EXECUTE format('CREATE ROLE %I NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE', producer);
            created := created || producer::text;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END;
    END IF;

    EXECUTE format('GRANT CONNECT ON DATABASE %I TO %I', current_database(), streamer);
    EXECUTE format('GRANT USAGE ON SCHEMA outbox TO %I', streamer);
    EXECUTE format('GRANT SELECT, INSERT ON outbox.dead_letter TO %I', streamer);
    EXECUTE format('GRANT USAGE ON SEQUENCE outbox.dead_letter_id_seq TO %I', streamer);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE ON outbox.stream_state TO %I', streamer);
    IF to_regclass('outbox.idempotency') IS NOT NULL THEN
        EXECUTE format('GRANT SELECT, DELETE ON outbox.idempotency TO %I', streamer);
    END IF;
    IF to_regclass('outbox.journal') IS NOT NULL THEN
        EXECUTE format('GRANT SELECT, INSERT, DELETE ON outbox.journal TO %I', streamer);
    END IF;

    EXECUTE format('GRANT USAGE ON SCHEMA outbox TO %I', producer);
    EXECUTE format('GRANT EXECUTE ON FUNCTION outbox.emit(text, jsonb, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text, text) TO %I', producer);
    EXECUTE format('GRANT EXECUTE ON FUNCTION outbox.emit_bytes(text, bytea, text, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text, text) TO %I', producer);
    EXECUTE format('GRANT INSERT ON outbox.idempotency TO %I', producer);

    RETURN array_to_string(created, ',');
END
$fn$;

-- pgoutbox-call (the binary runs everything above, then this call with its own names)
SELECT pg_temp.pgoutbox_create_roles('pgoutbox_streamer', 'pgoutbox_producer');
