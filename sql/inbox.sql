-- pgoutbox consumer-side inbox (PostgreSQL 14+; tested on 15).
--
-- Installed by `pgoutbox setup`, and usable on its own in any database (the consumer's
-- database is often not the producer's): `psql -d consumer_db -f sql/inbox.sql`. It creates
-- schema outbox if missing and needs nothing else from pgoutbox.
--
-- A consumer applies an event exactly once by claiming its id in the SAME transaction as the
-- event's side effect:
--
--   BEGIN;
--   SELECT outbox.inbox_claim('billing', $message_id, $tenant);   -- true: new, false: seen
--   -- only when true: the side effect (UPDATE accounts ..., INSERT ...)
--   COMMIT;
--   -- then, and only then, acknowledge the delivery to the broker.
--
-- The claim and the side effect commit together or not at all. A delivery seen again (the
-- broker redelivers after a crash between COMMIT and the ack, a duplicate publish, another
-- consumer on the same queue) claims false and is acknowledged without applying anything.
-- Two transactions claiming the same key at once: the second INSERT waits for the first
-- transaction, then inserts (first rolled back: true) or does nothing (first committed: false).
--
-- Keys: (consumer, tenant, message_id). A NULL tenant is one tenant of its own, not a
-- wildcard: it is stored as '' (coalesce(tenant, '')), so a NULL tenant and the empty tenant
-- '' are the same tenant. (PostgreSQL 14 has no NULLS NOT DISTINCT, hence the '' default.)
--
-- Retention: outbox.inbox_purge(retention, batch_size) deletes rows received longer ago than
-- `retention` (`pgoutbox maintenance` calls it). Keep the retention well above the longest
-- time a message can take to come back (redelivery, a requeue from a dead-letter queue, a
-- broker restored from a backup): a message redelivered after its row was purged is applied
-- again.
--
-- Privileges: nothing is granted here. A consumer role needs USAGE on schema outbox,
-- INSERT and SELECT on outbox.inbox (the functions are SECURITY INVOKER) and EXECUTE on
-- outbox.inbox_claim (functions get EXECUTE for PUBLIC by default), e.g.
--   GRANT USAGE ON SCHEMA outbox TO my_consumer;
--   GRANT SELECT, INSERT ON outbox.inbox TO my_consumer;
-- and whoever purges needs DELETE on it as well.
--
-- Idempotent: safe to run again (IF NOT EXISTS, CREATE OR REPLACE). Rows are never touched.
-- The functions pin search_path to pg_catalog, pg_temp and qualify every name.

CREATE SCHEMA IF NOT EXISTS outbox;

CREATE TABLE IF NOT EXISTS outbox.inbox (
    -- Who applied the message: one name per consuming service (or per handler), so that two
    -- services consuming the same event each apply it once.
    consumer    text NOT NULL,
    -- The producer's tenant (header x-pgoutbox-tenant); NULL tenant stored as ''.
    tenant      text NOT NULL DEFAULT '',
    -- The AMQP message-id property (outbox.emit's message_id).
    message_id  text NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, tenant, message_id)
);

CREATE INDEX IF NOT EXISTS inbox_received_at ON outbox.inbox (received_at);

COMMENT ON TABLE outbox.inbox IS
    'pgoutbox inbox: the messages each consumer has applied, claimed by outbox.inbox_claim in the transaction of the side effect. A NULL tenant is stored as ''''. Purged by outbox.inbox_purge.';

-- True exactly once per (consumer, coalesce(tenant, ''), message_id): when this call
-- recorded the key. False when it was recorded before (by a committed transaction, or by
-- this one). Never NULL. Call it inside the transaction that applies the message.
CREATE OR REPLACE FUNCTION outbox.inbox_claim(
    consumer text,
    message_id text,
    tenant text DEFAULT NULL
) RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    claimed bigint;
BEGIN
    IF inbox_claim.consumer IS NULL OR inbox_claim.consumer = '' THEN
        RAISE EXCEPTION 'outbox.inbox_claim: argument consumer must not be NULL or empty (got %)',
                coalesce(quote_literal(inbox_claim.consumer), 'NULL')
            USING ERRCODE = '22023',
                  HINT = 'Pass the name of the consuming service, the same on every call, e.g. ''billing''.';
    END IF;
    IF inbox_claim.message_id IS NULL OR inbox_claim.message_id = '' THEN
        RAISE EXCEPTION 'outbox.inbox_claim: argument message_id must not be NULL or empty (got %)',
                coalesce(quote_literal(inbox_claim.message_id), 'NULL')
            USING ERRCODE = '22023',
                  HINT = 'Pass the message''s id (the AMQP message-id property set by outbox.emit); a message without one cannot be applied exactly once.';
    END IF;

    INSERT INTO outbox.inbox (consumer, tenant, message_id)
    VALUES (inbox_claim.consumer, coalesce(inbox_claim.tenant, ''), inbox_claim.message_id)
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS claimed = ROW_COUNT;
    RETURN claimed = 1;
END
$fn$;

COMMENT ON FUNCTION outbox.inbox_claim(text, text, text) IS
    'pgoutbox inbox: true exactly once per (consumer, coalesce(tenant, ''''), message_id), false afterwards, never NULL. Call it in the transaction of the side effect; apply the message only when true.';

-- Deletes the inbox rows received before now() - retention, batch_size rows per DELETE
-- statement, until none is left; returns how many it deleted. Each batch is a short
-- statement on the received_at index, but a function runs in its caller's transaction: all
-- batches commit together. Rows locked by a concurrent purge are skipped (SKIP LOCKED).
CREATE OR REPLACE FUNCTION outbox.inbox_purge(
    retention interval,
    batch_size integer DEFAULT 1000
) RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    cutoff  timestamptz;
    batch   bigint;
    total   bigint := 0;
BEGIN
    IF retention IS NULL OR retention < interval '0' THEN
        RAISE EXCEPTION 'outbox.inbox_purge: argument retention must be a non-negative interval (got %)',
                coalesce(retention::text, 'NULL')
            USING ERRCODE = '22023',
                  HINT = 'Pass how long to keep claimed ids, e.g. interval ''7 days''; rows received before now() - retention are deleted.';
    END IF;
    IF batch_size IS NULL OR batch_size < 1 THEN
        RAISE EXCEPTION 'outbox.inbox_purge: argument batch_size must be a positive integer (got %)',
                coalesce(batch_size::text, 'NULL')
            USING ERRCODE = '22023',
                  HINT = 'Pass the number of rows to delete per statement, e.g. 1000 (the default).';
    END IF;

    cutoff := now() - retention;
    LOOP
        DELETE FROM outbox.inbox
        WHERE ctid = ANY (ARRAY(
            SELECT ctid FROM outbox.inbox
            WHERE received_at < cutoff
            ORDER BY received_at
            LIMIT batch_size
            FOR UPDATE SKIP LOCKED));
        GET DIAGNOSTICS batch = ROW_COUNT;
        total := total + batch;
        EXIT WHEN batch < batch_size;
    END LOOP;
    RETURN total;
END
$fn$;

COMMENT ON FUNCTION outbox.inbox_purge(interval, integer) IS
    'pgoutbox inbox: deletes rows received before now() - retention, batch_size rows per statement; returns the number deleted.';
